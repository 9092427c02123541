"""Who leads and what every manager does besides: the lease and its fence (leader.py), the world
loaded at start-up (loading.py), the fleet of managers sharing PostgreSQL (fleet.py: agent
streams and watches on every manager, commands for other managers' agents) and its balance
(balance.py)."""
