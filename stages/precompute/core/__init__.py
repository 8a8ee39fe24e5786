"""Stage one's ground floor: what every part of it reads and nothing of it below: the options (``options``) and the
plan the parts take instead (``plan``), the targets they resolve to against the teacher's config (``targets``), the
loaded teacher and its fingerprints (``teacher_id``), progress and the run's summary (``progress``),
``PrecomputeError`` (``errors``), and one try at the hub before its local cache only (``hub``).

No front door: import each name from the module that defines it.
"""
