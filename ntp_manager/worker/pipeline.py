"""Pipeline stages: cutting a model into stages by layer, and moving activations between stages
whose TP degrees differ.

    pipe = Pipeline(inputs=lambda b: b[0],                                  # stage 0's input
                    loss=lambda logits, b: cross_entropy(logits, b[1]))     # on the last stage
    rt = Runtime(model_fn, None, optimizer_fn, source, store, cfg, pipeline=pipe)

A replica is a pipeline of stages; each stage is a TP group of its own degree. `stage_module(model,
stage, n_stages)` gives stage s of a whole model: the embedding in stage 0, the final norm and the
LM head in the last stage, the transformer layers cut into contiguous runs (`split_layers`). The
stage keeps the whole model's module paths (`blocks.5.attn.q` stays `blocks.5.attn.q`, the layers
in an `nn.ModuleDict` keyed by their index), so the model's TP plan applies unchanged and a stage's
parameters compare one to one with the whole model's. Known models: `tiny_gpt.TinyGpt` and Hugging
Face Llama (`LlamaForCausalLM`, built from its config). Tied input and output embeddings are
refused when the embedding and the head land in different stages: the two stages would hold two
copies of one weight, each trained with half its gradient.

Activations between stages do not depend on either side's TP degree. After a stage's last row-
parallel all-reduce every rank of its TP group holds the same (replicated) output, and the input
gradient of a stage is replicated too (every use of the input enters the sharded layers through
the all-reduce of Megatron's f operator). So with degrees tp_s and tp_{s+1}:

- forward: rank j of stage s+1 receives the whole activation from rank j mod tp_s of stage s;
- backward: rank i of stage s receives the whole input gradient from rank i mod tp_{s+1} of
  stage s+1.

`activation_peers` gives both directions (pure). Every message is a whole tensor (a small header
with its shape and dtype, and the sender's schedule and micro-batch, goes first in the forward
direction; a gradient has its activation's shape), so a stage whose degree changes needs nothing
from its neighbours but the new numbering. Messages go through the transport seam
(worker/comm.py), like every other message of the runtime.

Schedules: `schedule_ops` (pure) orders a stage's forwards and backwards -- 1F1B, which keeps at
most `n_stages - stage` micro-batches' activations, or GPipe, which keeps all -- and `run_stage`
runs that order on a rank: asynchronous sends, a blocking receive only for what the next operation
needs, so the schedules complete on gloo whatever the stages' TP degrees (docs/worker.md,
"Schedules, recomputation and precision").
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ntp_manager.worker import comm
from ntp_manager.worker.tiny_gpt import run_block
from ntp_manager.worker.tp import ShardStyle


@dataclass(frozen=True)
class Pipeline:
    """How the runtime feeds a model cut into stages. `inputs(micro_batch)` is stage 0's input;
    `loss(output, micro_batch)` the mean loss over the micro-batch's samples, from the last
    stage's output; `split(model, stage, n_stages)` the stage module (`stage_module` knows TinyGpt
    and HF Llama). `micro_batches`: per replica and step (0: as many as stages); a replica whose
    local batch is smaller runs one sample per micro-batch."""

    inputs: Callable[[Any], Any]
    loss: Callable[[torch.Tensor, Any], torch.Tensor]
    split: Callable[[nn.Module, int, int], nn.Module] | None = None
    micro_batches: int = 0

    def stage(self, model: nn.Module, stage: int, n_stages: int) -> nn.Module:
        return (self.split or stage_module)(model, stage, n_stages)


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous runs of layers, one per stage, as even as possible; the earlier stages take the
    remainder (the last stage also holds the LM head). Raises ValueError when there are fewer
    layers than stages (a stage without layers is not supported)."""
    if n_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {n_stages}")
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} pipeline stages (one layer each at least)")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def micro_batches(local_batch: int, n: int) -> list[tuple[int, int]]:
    """(offset, count) of each micro-batch of a replica's local batch: `n` as even runs of
    consecutive samples (fewer when the batch is smaller). The replica's loss is the sum of the
    micro-batches' mean losses, each weighted by count / local_batch: the mean over its samples."""
    if local_batch < 1:
        raise ValueError(f"local batch must be >= 1, got {local_batch}")
    n = max(1, min(n, local_batch))
    base, extra = divmod(local_batch, n)
    out, off = [], 0
    for k in range(n):
        c = base + (1 if k < extra else 0)
        out.append((off, c))
        off += c
    return out


@dataclass(frozen=True)
class Peers:
    """One rank's neighbours in its replica's pipeline, as TP indices of the adjacent stages."""

    recv_input: int | None  # stage s-1 index sending this rank its input (None on stage 0)
    send_output: tuple[int, ...]  # stage s+1 indices this rank sends its output to
    recv_grad: int | None  # stage s+1 index sending this rank its output's gradient (None on the last stage)
    send_grad: tuple[int, ...]  # stage s-1 indices this rank sends its input's gradient to


def activation_peers(degrees: Sequence[int], stage: int, index: int) -> Peers:
    """Who rank `index` of `stage` exchanges activations with, given the replica's stage degrees
    (module docstring: forward from j mod tp_{s-1}, backward from i mod tp_{s+1})."""
    n = len(degrees)
    if not 0 <= stage < n or not 0 <= index < degrees[stage]:
        raise ValueError(f"no TP index {index} in stage {stage} of degrees {list(degrees)}")
    recv_input = index % degrees[stage - 1] if stage > 0 else None
    send_output = tuple(k for k in range(degrees[stage + 1]) if k % degrees[stage] == index) if stage < n - 1 else ()
    recv_grad = index % degrees[stage + 1] if stage < n - 1 else None
    send_grad = tuple(k for k in range(degrees[stage - 1]) if k % degrees[stage] == index) if stage > 0 else ()
    return Peers(recv_input, send_output, recv_grad, send_grad)


def stage_plan(plan: Mapping[str, ShardStyle], stage: nn.Module) -> Mapping[str, ShardStyle]:
    """The part of a whole model's TP plan that matches modules of `stage` (a middle stage has no
    vocabulary layers, say), with the plan's fix-up. A `plans.ModelPlan` stays one, with the unit
    counts of the families the stage uses."""
    from ntp_manager.worker.plans import ModelPlan

    paths = [p for p, _ in stage.named_modules()]
    styles = {pat: st for pat, st in plan.items() if any(fnmatch.fnmatchcase(p, pat) for p in paths)}
    if isinstance(plan, ModelPlan):
        fams = {st.family for st in styles.values()}
        return ModelPlan(styles, {f: n for f, n in plan.units.items() if f in fams}, plan.kind, plan.fixup)
    return styles


# ---- stage modules ------------------------------------------------------------------------------
def stage_module(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """Stage `stage` of `n_stages` of a whole (unsharded) model; shares its modules, so build the
    model for this purpose. Raises ValueError for a model it does not know, fewer layers than
    stages, or tied embeddings split over two stages."""
    from ntp_manager.worker.tiny_gpt import TinyGpt

    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is not in a pipeline of {n_stages}")
    if isinstance(model, TinyGpt):
        return TinyGptStage(model, stage, n_stages)
    kind = getattr(getattr(model, "config", None), "model_type", None)
    inner = getattr(model, "model", None)
    if kind == "llama" and hasattr(model, "lm_head") and hasattr(inner, "layers") and hasattr(inner, "embed_tokens"):
        return LlamaStage(model, stage, n_stages)
    raise ValueError(f"no pipeline split for {type(model).__name__} (model_type {kind!r}); splits exist for TinyGpt "
                     "and HF LlamaForCausalLM. Give Pipeline(split=...) a function (model, stage, n_stages) -> module "
                     "that keeps the model's module paths")


def _refuse_tied_across(first: nn.Parameter, last: nn.Parameter, n_stages: int, what: str) -> None:
    if n_stages > 1 and first is last:
        raise ValueError(f"{what}: the input embedding and the LM head are one tied weight, and a pipeline of "
                         f"{n_stages} stages puts them in different stages, which would train two copies with half "
                         "the gradient each; untie them (tie_word_embeddings=False) or run one stage")


class _Stage(nn.Module):
    recompute = False  # TinyGpt stages: recompute each block in the backward (set from the whole model)
    stage: int
    n_stages: int
    layer_ids: range

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1


class TinyGptStage(_Stage):
    """A stage of `TinyGpt`: `tok` and `pos` on stage 0, `blocks.<i>` of its layers, `ln` and
    `head` on the last stage. Input: token ids on stage 0, hidden states elsewhere; output: the
    logits on the last stage, hidden states elsewhere."""

    tok: nn.Module
    pos: nn.Module
    ln: nn.Module
    head: nn.Module

    def __init__(self, full: Any, stage: int, n_stages: int) -> None:
        super().__init__()
        self.stage, self.n_stages = stage, n_stages
        self.config = full.config
        self.recompute = bool(full.recompute)
        self.layer_ids = split_layers(len(full.blocks), n_stages)[stage]
        if self.first:
            self.tok, self.pos = full.tok, full.pos
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in self.layer_ids})
        if self.last:
            self.ln, self.head = full.ln, full.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for blk in self.blocks.values():
            x = run_block(blk, x, self.recompute)
        out: torch.Tensor = self.head(self.ln(x)) if self.last else x
        return out


class LlamaStage(_Stage):
    """A stage of a Hugging Face `LlamaForCausalLM`: `model.embed_tokens` on stage 0,
    `model.layers.<i>` of its layers (with the rotary embedding, which has no parameters, on every
    stage), `model.norm` and `lm_head` on the last stage. It computes what the whole model's
    forward computes for input ids without padding (causal mask from the config, positions
    0..T-1, no cache); the last stage gives the logits."""

    lm_head: nn.Module
    config: Any

    def __init__(self, full: Any, stage: int, n_stages: int) -> None:
        super().__init__()
        inner: Any = full.model
        _refuse_tied_across(inner.embed_tokens.weight, full.lm_head.weight, n_stages, "llama")
        self.stage, self.n_stages = stage, n_stages
        self.config = full.config
        self.layer_ids = split_layers(len(inner.layers), n_stages)[stage]
        body = nn.Module()
        if self.first:
            body.embed_tokens = inner.embed_tokens
        body.layers = nn.ModuleDict({str(i): inner.layers[i] for i in self.layer_ids})
        body.rotary_emb = inner.rotary_emb
        if self.last:
            body.norm = inner.norm
            self.lm_head = full.lm_head
        self.model = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # recomputation: the layers' own gradient-checkpointing flags, set by the whole model's
        # switch (worker/recompute.py) before it was cut; each layer checks them when called
        from transformers.masking_utils import create_causal_mask

        body: Any = self.model
        h = body.embed_tokens(x) if self.first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                                  position_ids=pos)
        pe = body.rotary_emb(h, position_ids=pos)
        for layer in body.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos, past_key_values=None,
                      use_cache=False)
        out: torch.Tensor = self.lm_head(body.norm(h)) if self.last else h
        return out


# ---- schedules ----------------------------------------------------------------------------------
SCHEDULES = ("1f1b", "gpipe")
Op = tuple[str, int]  # ("F", k): forward of micro-batch k; ("B", k): its backward


def schedule_ops(kind: str, n_stages: int, stage: int, n_micro: int) -> list[Op]:
    """The order in which `stage` of `n_stages` runs the forwards and backwards of `n_micro`
    micro-batches (pure; every rank of a stage runs the same list).

    - "gpipe": every forward, then every backward in reverse. A stage holds all `n_micro`
      micro-batches' activations at once.
    - "1f1b" (PipeDream-flush, as Megatron-LM's non-interleaved schedule): a warm-up of
      min(n_stages - stage - 1, n_micro) forwards, then one forward and one backward in turn, then
      a cool-down of the remaining backwards, in micro-batch order. Stage s holds at most
      min(n_stages - s, n_micro) micro-batches' activations; any n_micro >= 1 works (with fewer
      micro-batches than stages the warm-up is shorter, nothing is refused).

    Both keep each direction of each stage pair in one order (forwards 0, 1, ...; backwards in the
    schedule's order on every stage), so the receiver's n-th message from a peer is the sender's
    n-th: the point-to-point messages need no tags. Sends are asynchronous and a rank blocks only
    on the receive an operation needs (the input of F, the output gradient of B); with that, both
    orders complete (tests/worker/test_pipeline.py simulates every small shape)."""
    if n_micro < 1 or not 0 <= stage < n_stages:
        raise ValueError(f"no schedule for stage {stage} of {n_stages} with {n_micro} micro-batches")
    if kind == "gpipe":
        return [("F", k) for k in range(n_micro)] + [("B", k) for k in reversed(range(n_micro))]
    if kind == "1f1b":
        warm = min(n_stages - stage - 1, n_micro)
        ops: list[Op] = [("F", k) for k in range(warm)]
        for i in range(n_micro - warm):
            ops += [("F", warm + i), ("B", i)]
        return ops + [("B", k) for k in range(n_micro - warm, n_micro)]
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {kind!r}")


def peak_live(ops: Sequence[Op]) -> int:
    """The most micro-batches whose forward has run and whose backward has not, over `ops`: how
    many micro-batches' activations the stage keeps at once."""
    live = peak = 0
    for what, _ in ops:
        live += 1 if what == "F" else -1
        peak = max(peak, live)
    return peak


def backwards_before(ops: Sequence[Op], op: Op) -> set[int]:
    """Micro-batches whose backward comes before `op` in `ops`."""
    return {k for what, k in ops[: ops.index(op)] if what == "B"}


@dataclass(frozen=True)
class Comm:
    """The point-to-point messages a stage posts together between two of its operations: the
    sends of the operation just run and the receive the next one needs, as one group (NCCL:
    one `batch_isend_irecv`). An activation's receive comes in two parts: its header goes in the
    group, its payload (whose shape the header gives) right after."""

    send_out: int | None = None  # micro-batch whose output goes to the next stage
    send_grad: int | None = None  # micro-batch whose input gradient goes to the previous stage
    recv_grad: int | None = None  # micro-batch whose output gradient comes from the next stage
    recv_in: int | None = None  # micro-batch whose input comes from the previous stage


Step = Op | Comm


def stage_steps(kind: str, n_stages: int, stage: int, n_micro: int) -> list[Step]:
    """`schedule_ops` with its messages: before each operation one `Comm` with the previous
    operation's sends and this one's receive (Megatron's send_forward_recv_backward and
    send_backward_recv_forward), and one after the last with its sends (pure).

    Why together: on NCCL a send does not complete until the peer posts the matching receive, and
    a rank's point-to-point operations run in the order posted. In 1F1B's steady state stage s
    sends output k and then wants gradient i while stage s+1 sends gradient i and then wants input
    k: posted apart, each send waits for a receive its peer posts only after its own send, and
    both hang (gloo buffers sends, so it does not show there). Posted together they meet.
    tests/worker/test_pipeline.py simulates every small shape with blocking sends."""
    last, first = stage == n_stages - 1, stage == 0
    out: list[Step] = []
    sends: dict[str, int] = {}
    for what, k in schedule_ops(kind, n_stages, stage, n_micro):
        recv = {"recv_in": k} if what == "F" and not first else {"recv_grad": k} if what == "B" and not last else {}
        if sends or recv:
            out.append(Comm(**sends, **recv))
        out.append((what, k))
        sends = {"send_out": k} if what == "F" and not last else {"send_grad": k} if what == "B" and not first else {}
    if sends:
        out.append(Comm(**sends))
    return out


# ---- moving activations -------------------------------------------------------------------------
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MAX_DIMS = 6
# dtype code, ndim, up to 6 sizes, then what the sender ran: its schedule, the micro-batch, the
# number of micro-batches (a receiver checks all three: two ranks of one job on different
# schedules would otherwise pair gradients of different micro-batches, of equal shapes, silently)
_HEADER = 2 + _MAX_DIMS + 3


@dataclass(frozen=True)
class Tag:
    """What an activation message says about where it belongs."""

    schedule: str
    micro_batch: int
    n_micro: int


def send_activation(t: torch.Tensor, dsts: Sequence[int], group: Any, tag: Tag) -> list[Any]:
    """Send a whole activation (header, then payload) to each of `dsts` (global ranks); returns
    the pending sends, which keep `t` alive."""
    head = _header(t, tag)
    t = t.contiguous()
    return comm.exchange([comm.P2P(True, x, d) for d in dsts for x in (head, t)], group)


def recv_activation(src: int, group: Any, device: torch.device | str, expect: Tag) -> torch.Tensor:
    """Receive a whole activation sent by `send_activation` from global rank `src`; raises
    ValueError when the sender ran another schedule or micro-batch than `expect` says."""
    head = torch.zeros(_HEADER, dtype=torch.int64)
    comm.irecv(head, src=src, group=group).wait()
    t = _payload_for(head, src, device, expect)
    comm.irecv(t, src=src, group=group).wait()
    return t


def _header(t: torch.Tensor, tag: Tag) -> torch.Tensor:
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(f"activations between stages must be float tensors of at most {_MAX_DIMS} dims, "
                         f"got {t.dtype} of shape {tuple(t.shape)}")
    head = torch.zeros(_HEADER, dtype=torch.int64)
    head[0], head[1] = _DTYPES.index(t.dtype), t.dim()
    head[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    head[2 + _MAX_DIMS :] = torch.tensor([SCHEDULES.index(tag.schedule), tag.micro_batch, tag.n_micro])
    return head


def _payload_for(head: torch.Tensor, src: int, device: torch.device | str, expect: Tag) -> torch.Tensor:
    """The empty tensor a received header announces; raises ValueError when the sender ran another
    schedule or micro-batch than `expect` says."""
    code, k, n = (int(x) for x in head[2 + _MAX_DIMS :])
    got = Tag(SCHEDULES[code] if 0 <= code < len(SCHEDULES) else f"#{code}", k, n)
    if got != expect:
        raise ValueError(f"rank {src} sent micro-batch {got.micro_batch} of {got.n_micro} under schedule "
                         f"{got.schedule!r} where micro-batch {expect.micro_batch} of {expect.n_micro} under "
                         f"{expect.schedule!r} was due: every rank of a job must run the same RuntimeConfig.schedule "
                         "and Pipeline.micro_batches")
    dtype, ndim = _DTYPES[int(head[0])], int(head[1])
    return torch.empty([int(x) for x in head[2 : 2 + ndim]], dtype=dtype, device=device)


# ---- running a stage ----------------------------------------------------------------------------
@dataclass(frozen=True)
class StageLinks:
    """This rank's neighbours in its replica's pipeline as global ranks (`activation_peers`
    through the replica's rank table), and the group the messages travel on."""

    n_stages: int
    stage: int
    recv_input: int | None
    send_output: tuple[int, ...]
    recv_grad: int | None
    send_grad: tuple[int, ...]
    group: Any

    @classmethod
    def of(cls, ranks: Sequence[Sequence[int]], stage: int, index: int, group: Any) -> StageLinks:
        """`ranks[s][j]`: the global rank of TP index j of stage s in this replica."""
        p = activation_peers([len(r) for r in ranks], stage, index)
        return cls(len(ranks), stage,
                   ranks[stage - 1][p.recv_input] if p.recv_input is not None else None,
                   tuple(ranks[stage + 1][k] for k in p.send_output),
                   ranks[stage + 1][p.recv_grad] if p.recv_grad is not None else None,
                   tuple(ranks[stage - 1][i] for i in p.send_grad), group)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1


Msg = tuple[bool, int, str, int]  # (send?, peer's global rank, "head" | "act" | "grad", micro-batch)


def comm_phases(c: Comm, links: StageLinks) -> list[list[Msg]]:
    """The messages of `c` on this rank, in the groups they are posted in (pure): the sends and
    the receive of a gradient or of an activation's header, then the activation's payload. Each
    output goes to every rank of `links.send_output` as header then payload (`send_activation`'s
    order)."""
    group: list[Msg] = []
    if c.send_out is not None:
        group += [(True, d, w, c.send_out) for d in links.send_output for w in ("head", "act")]
    if c.send_grad is not None:
        group += [(True, d, "grad", c.send_grad) for d in links.send_grad]
    if c.recv_grad is not None:
        assert links.recv_grad is not None
        group.append((False, links.recv_grad, "grad", c.recv_grad))
    if c.recv_in is None:
        return [group]
    assert links.recv_input is not None
    return [[*group, (False, links.recv_input, "head", c.recv_in)], [(False, links.recv_input, "act", c.recv_in)]]


@dataclass(frozen=True)
class PassResult:
    loss: float  # the replica's loss (sum of count_k / local_batch x micro-batch k's mean); 0 off the last stage
    peak_live: int  # the most micro-batches this rank held activations of at once


def run_stage(model: nn.Module, pipe: Pipeline, kind: str, links: StageLinks, parts: Sequence[tuple[int, int]],
              local_batch: int, batch_of: Callable[[int, int], Any], device: torch.device | str) -> PassResult:
    """Forward and backward of this rank's stage over the replica's micro-batches `parts`
    ((offset, count) in its local batch), in the order `schedule_ops(kind, ...)` gives. The input
    comes from the previous stage (stage 0: `pipe.inputs(batch_of(offset, count))`), the output
    goes to the next stage; the output gradient comes back from the next stage (last stage: the
    loss's backward) and the input gradient goes to the previous stage. Gradients accumulate in
    the parameters' `.grad`; micro-batch k's loss is weighted count_k / local_batch, so the
    replica's gradient and loss are the means over its samples, as one pass would give.

    The messages go as `stage_steps` and `comm_phases` say: between two operations the sends of
    the first and the receive of the second are posted together, so the schedule completes on
    NCCL (where a send waits for its receive) as on gloo. Sends are not waited for at once; their
    buffers are let go as soon as the peer provably has them:
    an output once its gradient is back, an input gradient once the previous stage has sent an
    input that its schedule runs after that backward. So what a stage keeps alive between
    operations is what the schedule says (`peak_live` micro-batches), not every message of the
    step."""
    n = len(parts)
    steps = stage_steps(kind, links.n_stages, links.stage, n)
    prev_ops = schedule_ops(kind, links.n_stages, links.stage - 1, n) if not links.first else []
    group = links.group
    inputs: dict[int, torch.Tensor | None] = {}  # micro-batch -> its received input (grad wanted)
    outputs: dict[int, torch.Tensor] = {}  # micro-batch -> its output (last stage: weighted loss)
    outgoing: dict[tuple[str, int], torch.Tensor] = {}  # ("head"|"act"|"grad", micro-batch) -> to send
    incoming: dict[tuple[str, int], torch.Tensor] = {}  # ("act"|"grad", micro-batch) -> received
    out_sends: dict[int, list[Any]] = {}  # micro-batch -> pending sends of its output
    grad_sends: dict[int, list[Any]] = {}  # micro-batch -> pending sends of its input gradient
    losses: list[torch.Tensor] = []
    live = peak = 0

    def post(c: Comm) -> None:
        """Post `c`'s groups (`comm_phases`), each as one exchange, and wait for their receives."""
        payload: torch.Tensor | None = None
        for msgs in comm_phases(c, links):
            ops = []
            for send, peer, what, k in msgs:
                if send:
                    t = outgoing[(what, k)]
                elif what == "head":
                    t = torch.zeros(_HEADER, dtype=torch.int64)
                elif what == "act":
                    assert payload is not None
                    t = payload
                else:
                    t = torch.empty_like(outputs[k])
                ops.append(comm.P2P(send, t, peer))
            works = comm.exchange(ops, group)
            for (send, _, what, k), w in zip(msgs, works, strict=True):
                if send:
                    (grad_sends if what == "grad" else out_sends).setdefault(k, []).append(w)
            for (send, peer, what, k), op, w in zip(msgs, ops, works, strict=True):
                if send:
                    continue
                w.wait()
                if what == "head":
                    payload = _payload_for(op.tensor, peer, device, Tag(kind, k, n))
                else:
                    incoming[(what, k)] = op.tensor
            del ops, works
        # posted (the pending sends keep them alive), or nobody to send them to (a rank of a wider
        # stage whose index no rank of the narrower neighbour maps to)
        if c.send_out is not None:
            del outgoing[("head", c.send_out)], outgoing[("act", c.send_out)]
        if c.send_grad is not None:
            del outgoing[("grad", c.send_grad)]

    for step in steps:
        if isinstance(step, Comm):
            post(step)
            continue
        what, k = step
        off, count = parts[k]
        tag = Tag(kind, k, n)
        if what == "F":
            mb = batch_of(off, count) if links.first or links.last else None
            if links.first:
                x, keep = pipe.inputs(mb), None
            else:
                keep = incoming.pop(("act", k)).requires_grad_(True)
                x = keep
                # the previous stage sent this input after every backward its schedule runs first:
                # those input gradients have arrived there
                for m in backwards_before(prev_ops, ("F", k)):
                    for w in grad_sends.pop(m, []):
                        w.wait()
            y = model(x)
            if links.last:
                loss = pipe.loss(y, mb) * (count / local_batch)
                losses.append(loss.detach())
                outputs[k] = loss
            else:
                outgoing[("head", k)] = _header(y, tag)
                outgoing[("act", k)] = y.detach().contiguous()
                outputs[k] = y
            inputs[k] = keep
            live += 1
            peak = max(peak, live)
        else:
            out = outputs.pop(k)
            if links.last:
                torch.autograd.backward(out)
            else:
                grad = incoming.pop(("grad", k))
                for w in out_sends.pop(k, []):  # the next stage has run this backward: it had the output
                    w.wait()
                torch.autograd.backward(out, grad)
                del grad
            x_in = inputs.pop(k)
            if x_in is not None:
                outgoing[("grad", k)] = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
            del out, x_in
            live -= 1
    for pending in (*out_sends.values(), *grad_sends.values()):
        for w in pending:
            w.wait()
    assert not outputs and not inputs and not outgoing and not incoming, (outputs, inputs, outgoing, incoming)
    total = float(torch.stack(losses).double().sum().item()) if losses else 0.0  # one host sync per pass
    return PassResult(total, peak)
