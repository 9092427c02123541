"""ntp-manager: a cluster resource manager for nonuniform tensor parallelism (NTP).

Per-node agents report GPU health, the manager packs partly failed scale-up domains into as few
data-parallel replicas as possible at reduced tensor-parallel degrees, sets power caps, and pushes
layouts to training workers that reshard live. See README.md and docs/.
"""

__version__ = "0.1.0"
