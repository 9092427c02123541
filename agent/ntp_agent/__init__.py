"""ntp-agent: the per-node daemon that reads GPU health and applies power caps."""
