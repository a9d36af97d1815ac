"""Reports read from a run's record alone: the doctor's diagnosis and its ``--apply`` prescription (``doctor.py``),
its evidence (``applied.py``, ``ranks.py``, ``wall_clock.py``), its fixes (``advice.py``) and the PNG plots
(``plots.py``).
"""
