"""Jobs for the pipeline runtime tests: tiny TinyGpt and HF Llama models (4 layers, so PP2 and PP4
fit), their batches and loss, the single-process reference, and layouts made by the real planner.

A job is named `<model>-<optimizer>[-<flag>...]`: `gpt-sgd`, `gpt-adamw`, `llama-sgd`, `llama-adamw`,
with flags `clip` (max_grad_norm), `rc` (activation recomputation), `gpipe` (the GPipe schedule
instead of the default 1F1B) and `bf16` (bf16 compute with fp32 master state; its reference is
one process doing the same, `reference`). Worker ids are the planner's GPU UUIDs
(`GPU-<domain>-<index>`), so a plan is a layout as it is."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ntp_manager.planner import Plan, PowerModel, Scheme, make_plan
from ntp_manager.worker.pipeline import Pipeline
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt
from tests.fakes.builders import cluster_from_counts, job
from tests.worker.compare import random_batches, train_reference

GPT = GptConfig(vocab=32, seq=8, d_model=24, heads=4, mlp=24, layers=4)
VOCAB, SEQ, MAX_BATCH = 32, 8, 8


def build(name: str) -> nn.Module:
    """The whole model of job `name` (the caller seeds)."""
    if name.startswith("gpt"):
        return TinyGpt(GPT)
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                         max_position_embeddings=32, bos_token_id=1, eos_token_id=2)
    return tf.LlamaForCausalLM(cfg)


CLIP = 0.05  # a job named "...-clip" clips gradients to this norm (below every step's norm here)
MICRO = 4  # micro-batches per replica and step: twice the stages of PP2 (1F1B's steady phase runs)


def flags(name: str) -> set[str]:
    return set(name.split("-")[2:])


def config(name: str) -> dict[str, Any]:
    """The job's RuntimeConfig fields beside the test's timeouts."""
    f = flags(name)
    return {"max_grad_norm": CLIP if "clip" in f else None, "schedule": "gpipe" if "gpipe" in f else "1f1b",
            "recompute": "rc" in f, "precision": "bf16" if "bf16" in f else "fp32"}


def optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if "-sgd" in name:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # eps 1e-6, as docs/worker.md explains: at 1e-8 AdamW turns fp32 rounding of near-zero
    # gradients into lr-sized steps. Measured on the TinyGpt here: only cutting the batch into
    # micro-batches (one process) moves blocks.3.ln1.bias by 4e-5 of its norm at eps 1e-8 and by
    # 3e-6 at 1e-6
    # two groups, as LLM training sets it up: weight decay on matrices only
    # bf16 jobs at lr 1e-3: an update then falls below bf16's resolution of a weight near 1 (2^-8),
    # which is what fp32 master state is for (a bf16-only optimizer loses it: the negative control)
    ps = list(params)
    return torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                              {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
                             lr=0.01 if name.startswith("gpt") and "bf16" not in flags(name) else 1e-3, eps=1e-6)


def schedule(name: str, opt: torch.optim.Optimizer) -> Any:
    """AdamW jobs: warmup over 3 steps, then cosine over 8 (a rank that joins or changes stage
    takes the schedule's position and the groups' learning rates from a peer); SGD jobs: none."""
    if "-adamw" not in name:
        return None
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 3) * 0.5 * (1 + math.cos(math.pi * s / 8)))


batch = random_batches(VOCAB, SEQ, MAX_BATCH, seed=500)


def loss_of(logits: torch.Tensor, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross entropy over the samples' tokens (every sample has SEQ tokens, so the mean of
    micro-batch means weighted by their sample counts is the mean over the batch), in fp32 also
    when the logits are bf16 (as Hugging Face's causal-LM loss does)."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[1].reshape(-1))


def pipeline(micro: int = MICRO) -> Pipeline:
    return Pipeline(inputs=lambda b: b[0], loss=loss_of, micro_batches=micro)


def logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx) if isinstance(model, TinyGpt) else model(input_ids=idx).logits
    return out  # type: ignore[no-any-return]


def initial(name: str) -> dict[str, torch.Tensor]:
    """The whole model's parameters as every run starts them (seed 0)."""
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in build(name).named_parameters()}


def reference(name: str, global_batches: Sequence[int],
              master: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole model, the same global batches, one pass over each. A `bf16` job's:
    the parameters, gradients and optimizer state fp32, each step's forward and backward on bf16
    copies of the parameters (torch.func.functional_call, not the runtime's code); with
    `master=False` the negative control instead: the model and its optimizer state in bf16."""
    torch.manual_seed(0)
    m = build(name)
    bf16 = "bf16" in flags(name)
    if bf16 and not master:
        m = m.to(torch.bfloat16)

    def run(idx: torch.Tensor) -> torch.Tensor:
        if not (bf16 and master):
            return logits(m, idx)
        copies = {k: v.to(torch.bfloat16) for k, v in m.named_parameters()}
        if isinstance(m, TinyGpt):
            out: torch.Tensor = functional_call(m, copies, (idx,))
            return out
        return functional_call(m, copies, (), {"input_ids": idx}).logits  # type: ignore[no-any-return]

    opt = optimizer(name, m.parameters())
    losses, params = train_reference(m, opt, (batch(s, 0, gb) for s, gb in enumerate(global_batches)),
                                     lambda b: loss_of(run(b[0]), b), schedule(name, opt),
                                     clip=CLIP if "clip" in flags(name) else None)
    return losses, {k: v.float() for k, v in params.items()}


# ---- layouts from the planner -------------------------------------------------------------------
def pipeline_job(tp: int, pp: int) -> Any:
    """ntp-pw with a boost too small to restore a reduced group's speed (max 1.1x): a reduced
    stage runs at its usable count while the replica's other stages stay at full degree, and the
    replica's batch shrinks, so a second failure makes the packer regroup."""
    return job(tp=tp, pp=pp, replicas=2, batch=MAX_BATCH // 2, min_tp=1, scheme=Scheme.NTP_PW, heads=4, mlp=24,
               power=PowerModel(max_boost=1.1))


def plan(tp: int, pp: int, failed: Sequence[tuple[int, int]], previous: Plan | None) -> Plan:
    return make_plan(cluster_from_counts([tp] * (2 * pp), failed), pipeline_job(tp, pp), previous)


def layout_doc(p: Plan) -> list[tuple[list[list[str]], int]]:
    """What `publish_layout` takes: per replica (in id order) its stages' GPUs, and its batch."""
    return [([list(g.gpus) for g in sorted(r.groups, key=lambda g: g.stage)], r.local_batch)
            for r in sorted(p.replicas, key=lambda r: r.replica_id)]


def gpu(domain: int, index: int) -> str:
    return f"GPU-{domain}-{index}"
