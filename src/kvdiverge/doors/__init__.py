"""The doors: every way in that a user calls, over one runner.

The Python call (:mod:`~kvdiverge.doors.measurement`, whose result is
:class:`~kvdiverge.doors.results.Measurement`), the teacher-forced screen
(:mod:`~kvdiverge.doors.screening`) and the command line (:mod:`~kvdiverge.doors.cli`), with
what only they need: the command line's arguments (:mod:`~kvdiverge.doors.arguments`), the
options of one call (:mod:`~kvdiverge.doors.measuring`) and the output folder
(:mod:`~kvdiverge.doors.outputs`). Nothing below imports a door; the workflow's jobs
(:mod:`kvdiverge.jobs`) are the fourth way in.
"""
