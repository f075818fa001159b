"""Workloads sg-opt optimizes: the Target protocol, target resolution, the subprocess worker, and
the bundled reference trainer ``haste_rec``. Imports nothing else from sg-opt, so a user's own
target needs only ``targets.protocol``."""
