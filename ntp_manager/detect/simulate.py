"""Synthetic step traces of a pipelined, tensor- and data-parallel job, with known fail-slows.

What a trace models (all seeded, numpy only, no clock):
- *Data.* Sequence lengths are long-tailed (log-normal, clipped to the micro-batch budget) and
  packed next-fit into micro-batches of at most `tokens_per_mb` tokens, as a packing data loader
  does: a micro-batch closes when the next sequence does not fit, so token counts vary and the
  sum of squared lengths varies a lot (one long sequence outweighs many short ones).
- *Compute.* A rank of stage s computes each micro-batch in
  (a_s*(tokens + per_seq*sequences) + b_s*sumsq)/tp + c_s seconds (the per-sequence term is one
  the detector's model does not have), times its GPU's static speed spread, a per-step jitter of
  the whole job, a per-step jitter of its own, a per-micro-batch jitter, and the fail-slow factor
  injected on it.
- *Waits.* Members of a TP group meet in collectives after every micro-batch: each waits for the
  slowest member, then the transfer (n_s*tokens*(tp-1)/tp, group-wide jitter) runs. So a slow GPU's
  peers wait for it while it waits least; a slow link raises every member's wait.
- *Injected, with ground truth:* persistent slowdowns of `slow_level` on random GPUs (or, with
  probability `group_share`, on a whole TP group: a node-level cause) at random times for
  tens to hundreds of steps; persistent data imbalance (one replica's loader draws longer
  sequences); persistent network slowness of one TP group. *Transient, must not count:*
  one-step compute spikes on single ranks and on whole groups, and 1-3 step network hiccups.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ntp_manager.detect.types import RankObservation, StepObservation


@dataclass(frozen=True, slots=True)
class TraceSpec:
    stages: int = 4
    tp: int = 4
    dp: int = 4
    micro_batches: int = 8
    tokens_per_mb: int = 8192
    steps: int = 1000
    warmup: int = 60  # no injected slowdown starts before this step
    # sequence lengths: log-normal with this median and sigma, clipped to [16, tokens_per_mb]
    seq_median: float = 600.0
    seq_sigma: float = 1.2
    # cost model (seconds) for stage s: a * scale_s per token, b = a * attn / tokens_per_mb per len^2
    a: float = 6e-6
    attn: float = 1.5  # a full-length sequence's attention costs `attn` x its linear part
    c: float = 0.002
    net: float = 0.15  # transfer cost per token as a share of a
    per_seq: float = 32.0  # a per-sequence cost worth this many tokens: truth the model lacks
    # noise (log-normal sigmas)
    gpu_spread: float = 0.01
    job_jitter: float = 0.02
    rank_jitter: float = 0.02
    mb_jitter: float = 0.02
    net_jitter: float = 0.05
    # injected fail-slows
    slow_level: float = 0.2  # time x (1 + slow_level)
    slow_episodes: int = 4
    slow_len: tuple[int, int] = (30, 300)
    group_share: float = 0.2
    # persistent non-GPU causes
    imbalance_episodes: int = 1
    imbalance_len: tuple[int, int] = (50, 200)
    imbalance_scale: float = 6.0  # median sequence length x this on the imbalanced replica
    network_episodes: int = 1
    network_len: tuple[int, int] = (50, 200)
    network_factor: float = 2.5
    # transients
    spikes_per_1k: float = 30.0  # single-rank one-step compute spikes, per 1,000 steps
    spike_factor: tuple[float, float] = (1.3, 3.0)
    group_stalls_per_1k: float = 10.0  # whole-group one-step compute stalls
    hiccups_per_1k: float = 20.0  # group network hiccups of 1-3 steps
    hiccup_factor: tuple[float, float] = (3.0, 10.0)
    seed: int = 0

    @property
    def ranks(self) -> int:
        return self.stages * self.tp * self.dp


@dataclass(frozen=True, slots=True)
class Episode:
    kind: str  # "slow", "imbalance" or "network"
    gpus: tuple[str, ...]  # the GPUs it affects
    groups: tuple[str, ...]  # the TP groups it affects
    start: int  # first affected step
    end: int  # first unaffected step
    factor: float
    scope: str = "gpu"  # for slow: "gpu" or "group"


def gpu_name(stage: int, replica: int, tp_rank: int) -> str:
    return f"GPU-s{stage}-r{replica}-t{tp_rank}"


def group_name(stage: int, replica: int) -> str:
    return f"r{replica}/s{stage}"


@dataclass(slots=True)
class Trace:
    spec: TraceSpec
    episodes: list[Episode]
    compute: np.ndarray  # (steps, stages, dp, tp) seconds
    wait: np.ndarray  # (steps, stages, dp, tp) seconds
    tokens: np.ndarray  # (steps, dp) int
    sumsq: np.ndarray  # (steps, dp) float
    gpus: list[str] = field(default_factory=list)  # flat, (stage, replica, tp_rank) order

    def observations(self) -> Iterator[StepObservation]:
        sp = self.spec
        groups = [group_name(s, r) for s in range(sp.stages) for r in range(sp.dp)]
        for t in range(sp.steps):
            comp = self.compute[t].reshape(-1).tolist()
            wt = self.wait[t].reshape(-1).tolist()
            tok = self.tokens[t].tolist()
            sq = self.sumsq[t].tolist()
            ranks = []
            i = 0
            for s in range(sp.stages):
                for r in range(sp.dp):
                    g = groups[s * sp.dp + r]
                    for _k in range(sp.tp):
                        ranks.append(RankObservation(self.gpus[i], s, g, sp.tp, comp[i], wt[i], tok[r], sq[r]))
                        i += 1
            yield StepObservation(t, tuple(ranks))


def _pack(
    rng: np.random.Generator, sp: TraceSpec, medians: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Next-fit packing for many loaders at once: row i draws a fresh stream of lengths with median
    `medians[i]` and fills `micro_batches` micro-batches of at most `tokens_per_mb` tokens, each
    closing when the next sequence does not fit. Returns tokens, sum(len^2) and sequence counts,
    each (rows, micro_batches)."""
    budget = sp.tokens_per_mb
    rows = len(medians)
    mean = np.minimum(medians * math.exp(sp.seq_sigma**2 / 2), budget)
    k = int(2 * sp.micro_batches * budget / float(mean.min())) + 64  # ample: 2x the expected need
    lengths = np.clip(rng.lognormal(np.log(medians)[:, None], sp.seq_sigma, (rows, k)), 16, budget).round()
    csum = np.concatenate([np.zeros((rows, 1)), np.cumsum(lengths, axis=1)], axis=1)
    csq = np.concatenate([np.zeros((rows, 1)), np.cumsum(lengths**2, axis=1)], axis=1)
    at = np.zeros(rows, dtype=np.int64)  # next unpacked sequence per row
    r = np.arange(rows)
    tok = np.zeros((rows, sp.micro_batches))
    sq = np.zeros((rows, sp.micro_batches))
    count = np.zeros((rows, sp.micro_batches))
    for m in range(sp.micro_batches):
        limit = csum[r, at] + budget
        end = (csum[:, 1:] <= limit[:, None]).sum(axis=1)  # sequences [at, end) fit
        if (end >= k).any():  # pragma: no cover - 2x the expected need ran out: astronomically rare
            raise RuntimeError("sequence stream exhausted while packing; raise the draw size")
        tok[:, m] = csum[r, end] - csum[r, at]
        sq[:, m] = csq[r, end] - csq[r, at]
        count[:, m] = end - at
        at = end
    return tok, sq, count


def _pick_window(rng: np.random.Generator, sp: TraceSpec, span: tuple[int, int]) -> tuple[int, int]:
    length = int(rng.integers(span[0], span[1] + 1))
    latest = max(sp.warmup, sp.steps - length)
    start = int(rng.integers(sp.warmup, latest + 1))
    return start, min(sp.steps, start + length)


def make_trace(sp: TraceSpec) -> Trace:
    """Generate one trace (deterministic in `sp.seed`)."""
    rng = np.random.default_rng(sp.seed)
    S, D, P, M, T = sp.stages, sp.dp, sp.tp, sp.micro_batches, sp.steps
    gpus = [gpu_name(s, r, k) for s in range(S) for r in range(D) for k in range(P)]
    episodes: list[Episode] = []

    # ---- episodes (distinct targets, so ground truth is unambiguous) ----
    slow = np.ones((T, S, D, P))
    used_groups: set[tuple[int, int]] = set()
    for _ in range(sp.slow_episodes):
        for _try in range(100):
            s, r = int(rng.integers(S)), int(rng.integers(D))
            if (s, r) not in used_groups:
                break
        used_groups.add((s, r))
        start, end = _pick_window(rng, sp, sp.slow_len)
        if rng.random() < sp.group_share:
            ks = list(range(P))
            scope = "group"
        else:
            ks = [int(rng.integers(P))]
            scope = "gpu"
        for k in ks:
            slow[start:end, s, r, k] *= 1 + sp.slow_level
        episodes.append(
            Episode("slow", tuple(gpu_name(s, r, k) for k in ks), (group_name(s, r),), start, end, 1 + sp.slow_level,
                    scope)
        )
    median_len = np.full((T, D), sp.seq_median)
    for _ in range(sp.imbalance_episodes):
        r = int(rng.integers(D))
        start, end = _pick_window(rng, sp, sp.imbalance_len)
        median_len[start:end, r] *= sp.imbalance_scale
        episodes.append(
            Episode("imbalance", tuple(gpu_name(s, r, k) for s in range(S) for k in range(P)),
                    tuple(group_name(s, r) for s in range(S)), start, end, sp.imbalance_scale)
        )
    netf = np.ones((T, S, D))
    for _ in range(sp.network_episodes):
        s, r = int(rng.integers(S)), int(rng.integers(D))
        start, end = _pick_window(rng, sp, sp.network_len)
        netf[start:end, s, r] *= sp.network_factor
        episodes.append(
            Episode("network", tuple(gpu_name(s, r, k) for k in range(P)), (group_name(s, r),), start, end,
                    sp.network_factor)
        )

    # ---- transients ----
    for _ in range(rng.poisson(sp.spikes_per_1k * T / 1000)):
        t, s, r, k = int(rng.integers(T)), int(rng.integers(S)), int(rng.integers(D)), int(rng.integers(P))
        slow[t, s, r, k] *= rng.uniform(*sp.spike_factor)
    for _ in range(rng.poisson(sp.group_stalls_per_1k * T / 1000)):
        t, s, r = int(rng.integers(T)), int(rng.integers(S)), int(rng.integers(D))
        slow[t, s, r, :] *= rng.uniform(*sp.spike_factor)
    for _ in range(rng.poisson(sp.hiccups_per_1k * T / 1000)):
        t, s, r = int(rng.integers(T)), int(rng.integers(S)), int(rng.integers(D))
        netf[t : t + int(rng.integers(1, 4)), s, r] *= rng.uniform(*sp.hiccup_factor)

    # ---- data ----
    tok, sq, seqs = _pack(rng, sp, median_len.reshape(-1))
    tok_mb, sq_mb, seqs_mb = (v.reshape(T, D, M) for v in (tok, sq, seqs))

    # ---- time ----
    scale = np.ones(S)
    scale[0] = 1.15  # embeddings
    scale[-1] = 1.25 if S > 1 else 1.4  # output layer and loss
    a = sp.a * scale  # (S,)
    b = a * sp.attn / sp.tokens_per_mb
    work = tok_mb + sp.per_seq * seqs_mb  # the per-sequence cost is outside the detector's model
    base = (a[None, :, None, None] * work[:, None] + b[None, :, None, None] * sq_mb[:, None]) / P + sp.c
    # base: (T, S, D, M) healthy seconds per micro-batch for one rank
    gpu_speed = rng.lognormal(0, sp.gpu_spread, (S, D, P))
    job = rng.lognormal(0, sp.job_jitter, T)
    rank = rng.lognormal(0, sp.rank_jitter, (T, S, D, P))
    mb = rng.lognormal(0, sp.mb_jitter, (T, S, D, P, M))
    per_rank = (gpu_speed[None] * job[:, None, None, None] * rank * slow)  # (T, S, D, P)
    t_mb = base[:, :, :, None, :] * per_rank[..., None] * mb  # (T, S, D, P, M)
    transfer = (sp.net * a[None, :, None, None] * tok_mb[:, None] * (P - 1) / P) * netf[..., None]
    transfer = transfer * rng.lognormal(0, sp.net_jitter, transfer.shape)  # (T, S, D, M)
    slowest = t_mb.max(axis=3, keepdims=True)
    wait_mb = slowest - t_mb + transfer[:, :, :, None, :]
    compute = t_mb.sum(axis=4)
    wait = wait_mb.sum(axis=4)
    return Trace(
        spec=sp, episodes=episodes, compute=compute, wait=wait,
        tokens=tok_mb.sum(axis=2).astype(np.int64), sumsq=sq_mb.sum(axis=2), gpus=gpus,
    )
