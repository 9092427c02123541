"""GPU backends: `nvml` (nvidia-ml-py) and `fake` (a seeded scenario file)."""
