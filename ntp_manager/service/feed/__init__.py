"""Layouts out to workers on every manager: the feed of layouts read from PostgreSQL (layouts.py),
workers' acks and step reports taken by any manager (workers.py), and agents' GPU counters
relayed to the leader (relay.py)."""
