"""Training-side library: layout client, NTP layers, NTP gradient sync and live resharding.

Imports torch; install with the `worker` extra. Nothing in the manager imports this package.
"""
