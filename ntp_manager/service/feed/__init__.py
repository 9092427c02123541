"""Layouts out to workers on every manager: the feed of layouts the leader offers and the others
read from the database (layouts.py),
workers' acks and step reports taken by any manager (workers.py), and agents' GPU counters
relayed to the leader (relay.py)."""
