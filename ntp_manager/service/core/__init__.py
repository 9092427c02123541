"""The manager's foundations: the world in memory (state.py), the kernel that changes it in fenced
transactions (kernel.py), the inputs' checks, the errors every edge maps, metrics, and the pure
decisions (policy.py). Every other room builds on this one; it imports none of them (but the
lease's NotLeader, which the fence raises)."""
