"""Reports read from a run's record alone: the doctor's diagnosis, its evidence and fixes, and the plots.

``doctor.py`` names the bottleneck (verdict, evidence, fixes) and writes ``report.md``, with the fixes
each verdict calls for in ``advice.py``; it reads what the run had on (``applied.py``), the user's own
post-processing and metrics (``algorithm.py``), the evidence across ranks and nodes (``ranks.py``) and
where the wall clock went (``wall_clock.py``); ``prescription.py`` turns a diagnosis into the
``FastTraining(...)`` line of ``doctor --apply``; ``plots.py`` draws every PNG of a record. Tables
comparing recipes belong to the demo harness (`monai_fast.apps.demo.compare`), which reads results
files, not records.
"""
