"""Failure model for the simulator: rates, hardware/software split, repair times, blast radius.

Seeded and reproducible: every random draw comes from the `random.Random` passed in.

Defaults follow the Llama 3 report (docs/references.md, "Failure rates"): 419 unexpected interruptions in 54
days on 16,384 GPUs, i.e. about 1.97e-5 failures per GPU-hour; 78% hardware (repaired in 3 or 5
days), 22% software (3 hours). Failures arrive as a Poisson process over the whole cluster; each
one hits a uniformly chosen GPU that is not already failed and, with the blast-radius
probabilities, takes that GPU alone, its node, or its whole domain.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

LLAMA3_RATE_PER_GPU_HOUR = 419 / (54 * 24 * 16_384)  # ~1.97e-5


class SimError(ValueError):
    """Invalid simulator input (the message says which and why)."""


@dataclass(frozen=True)
class FailureModel:
    rate_per_gpu_hour: float = LLAMA3_RATE_PER_GPU_HOUR
    rate_multiplier: float = 1.0
    hardware_share: float = 0.78
    hardware_repair_h: float = 72.0
    software_repair_h: float = 3.0
    repair_distribution: str = "fixed"  # "fixed" or "exponential" (same mean)
    blast_node: float = 0.0  # probability that a failure takes the whole node
    blast_domain: float = 0.0  # probability that it takes the whole domain

    def validate(self) -> None:
        if self.rate_per_gpu_hour < 0 or not math.isfinite(self.rate_per_gpu_hour):
            raise SimError(f"failure rate must be a non-negative number, got {self.rate_per_gpu_hour}")
        if self.rate_multiplier < 0:
            raise SimError(f"rate multiplier must be >= 0, got {self.rate_multiplier}")
        if not 0 <= self.hardware_share <= 1:
            raise SimError(f"hardware share must be in [0, 1], got {self.hardware_share}")
        if self.hardware_repair_h <= 0 or self.software_repair_h <= 0:
            raise SimError("repair times must be positive")
        if self.repair_distribution not in ("fixed", "exponential"):
            raise SimError(f"repair distribution must be 'fixed' or 'exponential', got {self.repair_distribution!r}")
        if self.blast_node < 0 or self.blast_domain < 0 or self.blast_node + self.blast_domain > 1:
            raise SimError("blast-radius probabilities must be >= 0 and sum to at most 1")

    @property
    def effective_rate(self) -> float:
        return self.rate_per_gpu_hour * self.rate_multiplier

    @property
    def mean_repair_h(self) -> float:
        return self.hardware_share * self.hardware_repair_h + (1 - self.hardware_share) * self.software_repair_h

    def steady_state_failed_fraction(self) -> float:
        """Little's law for single-GPU failures: rate x mean repair time (when small)."""
        return self.effective_rate * self.mean_repair_h

    def draw_repair_h(self, rng: random.Random) -> tuple[float, bool]:
        hardware = rng.random() < self.hardware_share
        mean = self.hardware_repair_h if hardware else self.software_repair_h
        if self.repair_distribution == "exponential":
            return rng.expovariate(1.0 / mean), hardware
        return mean, hardware

    def draw_radius(self, rng: random.Random) -> str:
        x = rng.random()
        if x < self.blast_domain:
            return "domain"
        if x < self.blast_domain + self.blast_node:
            return "node"
        return "gpu"
