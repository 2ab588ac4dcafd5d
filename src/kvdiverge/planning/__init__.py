"""Planning a study before it runs: its cost and its GPU time, from the config alone.

What a config asks of the machines (:mod:`~kvdiverge.planning.cost`: documents, forwards and
token-steps per run) and what that takes on a GPU (:mod:`~kvdiverge.planning.roofline`:
weights, FLOPs, a roofline, a SLURM request). No model is loaded; nothing here runs a job.
"""
