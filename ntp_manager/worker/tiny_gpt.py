"""A small GPT-style model, written here, for tests, benchmarks and examples/train_gpt.py.

Plain torch: attention reshapes with `view(B, T, -1, head_dim)`, so a tensor-parallel shard with any
number of heads runs unchanged. `tp_plan` shards it by module path (see worker/tp.py) and
`unit_counts` gives its unit families' sizes. `recompute = True` recomputes each block's
activations in the backward instead of keeping them (torch.utils.checkpoint, non-reentrant): the
switch `worker/recompute.py` turns on (`run_block`, which the pipeline's stages use too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ntp_manager.worker.tp import ColwiseUnits, RowwiseUnits, ShardStyle


@dataclass(frozen=True)
class GptConfig:
    vocab: int = 256
    seq: int = 32
    d_model: int = 64
    heads: int = 8
    mlp: int = 256
    layers: int = 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


class Attention(nn.Module):
    def __init__(self, c: GptConfig) -> None:
        super().__init__()
        self.hd = c.head_dim
        self.q = nn.Linear(c.d_model, c.d_model)
        self.k = nn.Linear(c.d_model, c.d_model)
        self.v = nn.Linear(c.d_model, c.d_model)
        self.o = nn.Linear(c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.hd).transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.o(y.transpose(1, 2).reshape(b, t, -1))
        return out


class Mlp(nn.Module):
    def __init__(self, c: GptConfig) -> None:
        super().__init__()
        self.up = nn.Linear(c.d_model, c.mlp)
        self.down = nn.Linear(c.mlp, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(nn.functional.gelu(self.up(x)))
        return out


class Block(nn.Module):
    def __init__(self, c: GptConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.mlp = Mlp(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


def run_block(block: nn.Module, x: torch.Tensor, recompute: bool) -> torch.Tensor:
    """`block(x)`; with `recompute` (and autograd recording) only `x` is kept for the backward,
    which runs the block's forward again."""
    if recompute and torch.is_grad_enabled():
        out: torch.Tensor = checkpoint(block, x, use_reentrant=False)
        return out
    res: torch.Tensor = block(x)
    return res


class TinyGpt(nn.Module):
    recompute = False  # activation recomputation per block (module docstring)

    def __init__(self, c: GptConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = run_block(blk, x, self.recompute)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy, in fp32 also when the logits are bf16 (RuntimeConfig(precision="bf16"))."""
        logits = self.forward(idx).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`Runtime.train_step`'s loss for a TinyGpt (sharded in place, so still a TinyGpt)."""
    if not isinstance(model, TinyGpt):
        raise TypeError(f"tiny_loss takes a TinyGpt, not a {type(model).__name__}")
    return model.loss(*batch)


def tp_plan(c: GptConfig) -> dict[str, ShardStyle]:
    """Heads, MLP columns and the vocabulary (the token embedding by rows, the LM head by output
    columns gathered for the loss), each a unit family of its own."""
    return {
        "tok": RowwiseUnits("vocab", 1),
        "head": ColwiseUnits("vocab", 1, gather_output=True),
        "blocks.*.attn.q": ColwiseUnits("heads", c.head_dim),
        "blocks.*.attn.k": ColwiseUnits("heads", c.head_dim),
        "blocks.*.attn.v": ColwiseUnits("heads", c.head_dim),
        "blocks.*.attn.o": RowwiseUnits("heads", c.head_dim),
        "blocks.*.mlp.up": ColwiseUnits("mlp", 1),
        "blocks.*.mlp.down": RowwiseUnits("mlp", 1),
    }


def unit_counts(c: GptConfig) -> dict[str, int]:
    """Family -> unit count under `tp_plan` (what `SyncLayout` takes)."""
    return {"heads": c.heads, "mlp": c.mlp, "vocab": c.vocab}
