"""Reports read from a run's record alone: the doctor's diagnosis (``doctor.py``), its evidence (``applied.py``,
``algorithm.py``, ``ranks.py``, ``wall_clock.py``), its fixes (``advice.py``, ``prescription.py``) and the PNG
plots (``plots.py``).
"""
