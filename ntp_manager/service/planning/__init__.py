"""The leader's decisions: jobs and their layouts (jobs.py), the planner run off the event loop
(planning.py, planproc.py), power caps, fail-slow verdicts, the circuit breaker, checkpoints and
restores, and the layout views operators read."""
