"""A pure step-time model: how long one training step of a dense transformer takes under TP x PP x DP.

What it decides. (1) The local batch a reduced replica can run without slowing the step (the
planner's reduced-batch rule when a job carries a `StepModel`), (2) the step time of a whole plan,
for the simulator's throughput, and (3) per-GPU utilisation of a parallel layout, to compare
scale-up domain sizes as the NTP paper does (87% with NVL32 vs 68% with NVL8 at 32K GPUs).

The model, per step (every term is stated so that it can be argued with):

- Compute: model FLOPs at a stated share of the GPU's peak (`Hardware.mfu`). Per layer and sequence
  of s tokens, forward: 2 s (4 h^2 + 2 h f) for the projections (the 4 h^2 follow the attention
  heads, the 2 h f the MLP columns) plus 2 s^2 h for causal attention; backward twice that; full
  activation recomputation one more forward. A rank's share is set by the units it holds: ceil(H/t)
  of H heads and ceil(C/t) of C MLP columns (`ntp_map`), so at TP31 of 128 heads a rank does 5/128
  of the attention, not 1/31 (with `balance="stage"` the extra units rotate over the layers of a
  stage and a rank's share is even, 1/t). Power boost scales compute speed only.
- TP communication (sequence parallel): per layer and pass 4 all-gathers / reduce-scatters of the
  layer's activations (s h x 2 bytes), each moving (t-1)/t of it per GPU at the links' collective
  bandwidth; over NVLink inside a domain; a TP group wider than its domain (t = t_in x t_out) sends
  (t_out-1)/t of it over the scale-out network. Each collective is paired with the GEMM it feeds or
  drains (all-gather -> q/k/v and MLP-in, o-proj and MLP-out -> reduce-scatter; backward: the
  dgrad + wgrad GEMMs, twice as long) and only what it sticks out beyond `tp_overlap` x that GEMM
  is exposed (1.0: comm-GEMM overlap as TransformerEngine's user buffers do it; 0: none).
- Pipeline: the 1F1B schedule with v interleaved chunks per stage; m microbatches of one sequence
  take (v max(m, p) + min(m, p) - 1) chunk times (m >= p: the familiar m v + p - 1; fewer
  microbatches than stages leave the pipeline latency-bound). The slowest stage holds ceil(L/p)
  layers. Stage-to-stage sends (b s h x 2 / t bytes per GPU) cross the scale-out network when a
  replica's stages sit in different domains, and add to the fill and drain.
- DP sync (distributed optimizer): a reduce-scatter of bf16 gradients and an all-gather of bf16
  parameters over the DP ranks, (dp-1)/dp x 2 bytes x parameters per GPU each, over the scale-out
  network; the reduce-scatter overlaps the last microbatch's backward, the all-gather the first
  forward, and only what sticks out counts. Under NTP a stage whose sync runs at degree t_sync < T
  moves T/t_sync as many bytes per core rank (docs/references.md).
- Memory decides what fits: bf16 weights + fp32 gradients (6 bytes per parameter of the rank's
  shard), the optimizer's 12 bytes per parameter divided over DP, and activations 34 s h / t bytes
  per layer and microbatch in flight (selective recomputation, Korthikanti et al.) or 2 s h / t with
  full recomputation; the first stage holds min(m, p) microbatches (x (1 + (p-1)/(p v)) interleaved).

Not modelled: context parallelism, expert parallelism, optimizer-step time, stragglers, kernel
launch and collective latency terms, and GEMM efficiency falling with shard width (one MFU for all).
Utilisation is the compute time at the stated MFU over the step time: 1.0 means nothing but compute.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from ntp_manager.contract.ntp_map import max_units_per_rank


class StepModelError(ValueError):
    """Invalid step-model input; the message says which field and why."""


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer. Defaults: the NTP paper's 480B model (docs/references.md)."""

    layers: int = 100
    hidden: int = 20_480
    heads: int = 128
    ffn: int = 81_920
    seq: int = 16_384

    @property
    def params_per_layer(self) -> int:
        return 4 * self.hidden**2 + 2 * self.hidden * self.ffn

    @property
    def params(self) -> int:
        return self.layers * self.params_per_layer

    def fwd_flops(self) -> tuple[float, float]:
        """Forward FLOPs per layer and sequence: (attention part, MLP part). The attention part holds
        the q/k/v/o projections and the causal score and value products; it splits by heads."""
        s, h = self.seq, self.hidden
        return 2.0 * s * 4 * h * h + 2.0 * s * s * h, 2.0 * s * 2 * h * self.ffn

    def step_flops(self, sequences: int) -> float:
        """Model FLOPs of one step (forward + backward, no recomputation)."""
        a, m = self.fwd_flops()
        return 3.0 * (a + m) * self.layers * sequences

    def validate(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn", "seq"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise StepModelError(f"model.{name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class Hardware:
    """A GPU and its links. Defaults: B200 (dense BF16 2.25 PFLOP/s, 192 GB HBM3e, NVLink 5 at
    900 GB/s per direction) with one 400 Gb/s NIC per GPU (50 GB/s)."""

    name: str = "B200"
    peak_flops: float = 2.25e15
    mfu: float = 0.5  # share of peak the kernels reach (the stated MFU)
    hbm_bytes: float = 192e9
    hbm_usable: float = 0.9  # allocator fragmentation, workspace, NCCL buffers
    nvlink_bw: float = 900e9  # bytes/s per direction per GPU
    scaleout_bw: float = 50e9  # bytes/s per GPU
    link_efficiency: float = 0.8  # collective bus bandwidth over link bandwidth
    tp_overlap: float = 1.0  # how well a TP collective hides behind the GEMM it feeds or drains

    @property
    def flops(self) -> float:
        return self.peak_flops * self.mfu

    def validate(self) -> None:
        for name in ("peak_flops", "hbm_bytes", "nvlink_bw", "scaleout_bw"):
            if not getattr(self, name) > 0:
                raise StepModelError(f"hardware.{name} must be positive")
        for name in ("mfu", "hbm_usable", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise StepModelError(f"hardware.{name} must be in (0, 1]")
        if not 0 <= self.tp_overlap <= 1:
            raise StepModelError("hardware.tp_overlap must be in [0, 1]")


Recompute = Literal["selective", "full"]
Balance = Literal["layer", "stage"]


@dataclass(frozen=True)
class Layout:
    """How one job is laid out: TP degree, pipeline depth, DP replicas, interleaved chunks per stage,
    recomputation, and the scale-up domain size (TP wider than a domain crosses the network)."""

    tp: int
    pp: int
    dp: int
    domain: int
    interleave: int = 1
    recompute: Recompute = "selective"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def validate(self, model: ModelShape) -> None:
        for name in ("tp", "pp", "dp", "domain", "interleave"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise StepModelError(f"layout.{name} must be a positive integer, got {v!r}")
        if self.tp > self.domain and self.tp % self.domain:
            raise StepModelError(f"TP {self.tp} wider than the domain {self.domain} must be a multiple of it")
        if self.pp > model.layers:
            raise StepModelError(f"pipeline depth {self.pp} exceeds the model's {model.layers} layers")
        if self.interleave > model.layers // self.pp:
            raise StepModelError(
                f"{self.interleave} chunks per stage, but a stage holds {model.layers // self.pp} layers"
            )
        if self.recompute not in ("selective", "full"):
            raise StepModelError(f"recompute must be 'selective' or 'full', got {self.recompute!r}")


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds of one step, by cause. `total` is the step time."""

    compute: float  # busy compute on the critical path: microbatches x per-microbatch compute
    tp_comm: float  # exposed TP communication on the critical path
    bubble: float  # pipeline fill and drain (compute + TP communication of the idle chunks)
    pp_comm: float  # stage-to-stage sends on the fill and drain
    dp_sync: float  # exposed DP reduce-scatter + all-gather
    ideal: float  # the step's model FLOPs per GPU at the stated MFU
    memory_bytes: float  # peak per-GPU memory of the first stage

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.bubble + self.pp_comm + self.dp_sync

    @property
    def utilisation(self) -> float:
        return self.ideal / self.total


@dataclass(frozen=True)
class StepModel:
    """Model + hardware + the job's healthy layout: what the planner needs to size reduced replicas."""

    model: ModelShape = field(default_factory=ModelShape)
    hardware: Hardware = field(default_factory=Hardware)
    layout: Layout = field(default_factory=lambda: Layout(tp=32, pp=8, dp=128, domain=32, interleave=12))
    balance: Balance = "layer"

    def validate(self) -> None:
        self.model.validate()
        self.hardware.validate()
        self.layout.validate(self.model)
        if self.balance not in ("layer", "stage"):
            raise StepModelError(f"balance must be 'layer' or 'stage', got {self.balance!r}")

    # ---- one replica ----------------------------------------------------------------------------

    def unit_shares(self, t: int) -> tuple[float, float]:
        """Share of the attention and of the MLP work the busiest rank holds at degree t."""
        if self.balance == "stage":
            return 1.0 / t, 1.0 / t
        m = self.model
        return max_units_per_rank(m.heads, t) / m.heads, max_units_per_rank(m.ffn, t) / m.ffn

    def chunk_times(self, t: int, speed: float = 1.0, t_out: int | None = None) -> tuple[float, float, float]:
        """(compute s, exposed TP communication s, memory bytes of activations per layer) of one
        layer and one microbatch (forward + backward) on a rank of a TP group of degree t whose
        GPUs run at relative compute `speed`."""
        m, hw, lay = self.model, self.hardware, self.layout
        s, h = m.seq, m.hidden
        sa, sm = self.unit_shares(t)
        rate = hw.flops * speed
        # forward GEMMs of one rank, each paired with the collective that feeds or drains it
        qkv = 2.0 * s * 3 * h * h * sa / rate
        proj = 2.0 * s * h * h * sa / rate
        fc1 = fc2 = 2.0 * s * h * m.ffn * sm / rate
        core = 2.0 * s * s * h * sa / rate  # causal attention scores and values (not paired)
        fwd = qkv + proj + fc1 + fc2 + core
        full = lay.recompute == "full"
        compute = fwd * (4.0 if full else 3.0)
        if t_out is None:
            t_out = max(1, t // lay.domain) if t > lay.domain else 1
        coll = 0.0
        if t > 1:
            act = 2.0 * s * h  # one activation tensor, bf16
            net = (t_out - 1) / t * act / (hw.scaleout_bw * hw.link_efficiency)
            nvl = (t - t_out) / t * act / (hw.nvlink_bw * hw.link_efficiency)
            coll = net + nvl
        hide = hw.tp_overlap
        gemms = (qkv, proj, fc1, fc2)
        exposed_fwd = sum(max(0.0, coll - hide * g) for g in gemms)
        exposed_bwd = sum(max(0.0, coll - hide * 2.0 * g) for g in gemms)  # dgrad + wgrad
        exposed = exposed_fwd * (2.0 if full else 1.0) + exposed_bwd
        per_layer_act = (2.0 if full else 34.0) * s * h / t
        return compute, exposed, per_layer_act

    def pipeline_time(self, t: int, microbatches: int, speed: float = 1.0) -> float:
        """Seconds for one replica at TP degree t to run `microbatches` microbatches through its
        pipeline (the healthy layout's depth and interleaving), without the DP sync."""
        if microbatches <= 0:
            return 0.0
        return _pipeline_cached(self, t, microbatches, speed)

    def _pipeline(self, t: int, m: int, speed: float) -> tuple[float, float, float, float, float]:
        """(total, busy compute, exposed TP comm, bubble, pp comm) of the pipeline."""
        mod, hw, lay = self.model, self.hardware, self.layout
        p, v = lay.pp, lay.interleave
        layers = math.ceil(mod.layers / p)
        c, x, _ = self.chunk_times(t, speed)
        stage = layers * (c + x)  # one microbatch through one stage, forward + backward
        chunk = stage / v
        slots = v * max(m, p) + min(m, p) - 1  # chunk times on the critical path
        busy = v * m
        p2p = 0.0
        if p > 1 and t * p > lay.domain:  # stages in different domains: sends cross the network
            send = 2.0 * mod.seq * mod.hidden / t / (hw.scaleout_bw * hw.link_efficiency)
            p2p = 2.0 * (p - 1) * send  # forward fill + backward drain
        total = slots * chunk + p2p
        compute = busy * chunk * c / (c + x)
        comm = busy * chunk * x / (c + x)
        return total, compute, comm, (slots - busy) * chunk, p2p

    def dp_sync_time(self, dp: int, t_sync: int | None = None) -> float:
        """Exposed DP sync seconds for `dp` replicas; `t_sync` (<= tp) is the sync degree of the
        stage with the most bytes per core rank (NTP: T / t_sync as many)."""
        lay, hw, mod = self.layout, self.hardware, self.model
        t = lay.tp
        ts = t if t_sync is None else t_sync
        if dp <= 1:
            return 0.0
        params_rank = mod.params / (lay.pp * ts)
        one = (dp - 1) / dp * 2.0 * params_rank / (hw.scaleout_bw * hw.link_efficiency)
        layers = math.ceil(mod.layers / lay.pp)
        c, x, _ = self.chunk_times(t)
        fwd = layers * (c + x) / (4.0 if lay.recompute == "full" else 3.0)
        bwd = layers * (c + x) - fwd
        return max(0.0, one - bwd) + max(0.0, one - fwd)

    def breakdown(self, sequences_per_replica: int | None = None) -> StepBreakdown:
        """The healthy step of the layout: every replica at TP `tp`, one sequence per microbatch."""
        mod, lay = self.model, self.layout
        m = sequences_per_replica if sequences_per_replica is not None else 1
        _, compute, comm, bubble, p2p = self._pipeline(lay.tp, m, 1.0)
        dp = self.dp_sync_time(lay.dp)
        ideal = mod.step_flops(m * lay.dp) / lay.gpus / self.hardware.flops
        return StepBreakdown(compute, comm, bubble, p2p, dp, ideal, self.memory_bytes(m))

    def memory_bytes(self, microbatches: int) -> float:
        """Peak bytes per GPU on the first stage (the one holding the most activations)."""
        mod, lay = self.model, self.layout
        layers = math.ceil(mod.layers / lay.pp)
        shard = mod.params_per_layer * layers / lay.tp
        states = shard * 6.0 + shard * 12.0 / lay.dp
        _, _, act = self.chunk_times(lay.tp)
        p, v = lay.pp, lay.interleave
        inflight = min(microbatches, p) * (1.0 + ((p - 1) / (p * v) if v > 1 else 0.0))
        return states + layers * act * inflight

    def fits(self, microbatches: int) -> bool:
        hw = self.hardware
        return self.memory_bytes(microbatches) <= hw.hbm_bytes * hw.hbm_usable

    # ---- the planner's rule ----------------------------------------------------------------------

    def reduced_batch(self, t: int, healthy_batch: int, speed: float = 1.0) -> int:
        """Largest number of sequences a replica at TP degree t (GPUs at relative compute `speed`)
        can run in no more time than a healthy replica runs `healthy_batch`."""
        target = self.pipeline_time(self.layout.tp, healthy_batch) * (1.0 + 1e-9)
        if self.pipeline_time(t, healthy_batch, speed) <= target:
            return healthy_batch
        lo, hi = 0, healthy_batch  # pipeline_time is increasing in the batch: bisect
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.pipeline_time(t, mid, speed) <= target:
                lo = mid
            else:
                hi = mid
        return lo


@functools.lru_cache(maxsize=65_536)
def _pipeline_cached(sm: StepModel, t: int, m: int, speed: float) -> float:
    return sm._pipeline(t, m, speed)[0]


# ---- choosing the best layout for a cluster (the paper's utilisation comparison) -------------------


@dataclass(frozen=True)
class Best:
    layout: Layout
    breakdown: StepBreakdown
    microbatches: int


def layouts(
    model: ModelShape, gpus: int, domain: int, sequences: int, max_tp: int = 64
) -> Iterator[tuple[Layout, int]]:
    """Every layout of `gpus` GPUs for a batch of `sequences` (one sequence per microbatch, every
    replica the same number): TP a power of two up to `max_tp` (dividing the heads), any pipeline
    depth, interleaving where the microbatches are a multiple of the depth (Megatron's rule)."""
    tp = 1
    while tp <= max_tp:
        if model.heads % tp == 0 and gpus % tp == 0 and (tp <= domain or tp % domain == 0):
            for pp in range(1, model.layers + 1):
                if gpus % (tp * pp):
                    continue
                dp = gpus // (tp * pp)
                if sequences % dp:
                    continue
                m = sequences // dp
                chunks = [1]
                if pp > 1 and m % pp == 0:
                    chunks = list(range(1, model.layers // pp + 1))
                for v in chunks:
                    for rc in ("selective", "full"):
                        yield Layout(tp, pp, dp, domain, v, rc), m
        tp *= 2


def best_layout(
    model: ModelShape, hardware: Hardware, gpus: int, domain: int, sequences: int, max_tp: int = 64
) -> Best | None:
    """The layout with the highest utilisation that fits in memory; None if none fits."""
    best: Best | None = None
    for lay, m in layouts(model, gpus, domain, sequences, max_tp):
        sm = StepModel(model, hardware, lay)
        if not sm.fits(m):
            continue
        b = sm.breakdown(m)
        if best is None or b.utilisation > best.breakdown.utilisation + 1e-12:
            best = Best(lay, b, m)
    return best


