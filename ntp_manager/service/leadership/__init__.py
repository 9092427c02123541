"""Who leads and what every manager does besides: the lease and its fence (leader.py), the world
loaded at start-up (loading.py), the fleet (fleet.py: agent streams and watches on every manager,
the leader's consumer; one design on both stores), what only managers sharing PostgreSQL need
(shared.py: notifications, commands for other managers' agents) and its balance (balance.py)."""
