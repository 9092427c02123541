"""Demonstrations of the manager, the agents and the worker together (`make demo`, `make slow-demo`,
`make ha-demo`, `python -m ntp_manager.demos.planner_demo`); not imported by the manager, agent or worker."""
