"""What operators do and see: cordons, drains and maintenance windows, API tokens, queries and
gauges, Slurm's drains, and the event-loop watchdog."""
