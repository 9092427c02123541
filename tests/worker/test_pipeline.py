"""Pipeline pieces without processes: the layer split, micro-batches, who sends activations to whom
whatever the stages' TP degrees, the schedules (simulated: they complete, pair every message with
its micro-batch, and keep at most the activations they promise), stage modules that compose to the
whole model exactly (TinyGpt, HF Llama; with activation recomputation too), the plan restricted to
a stage, and the refusals (tied embeddings across stages, too few layers, unknown models, an
unknown schedule)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ntp_manager.worker.pipeline import (
    SCHEDULES,
    Comm,
    Msg,
    Op,
    StageLinks,
    Step,
    activation_peers,
    comm_phases,
    micro_batches,
    peak_live,
    schedule_ops,
    split_layers,
    stage_module,
    stage_plan,
    stage_steps,
)
from ntp_manager.worker.plans import plan_for
from ntp_manager.worker.recompute import RecomputeError, enable_recompute
from tests.worker import pipeline_jobs as pj


def test_split_layers_is_contiguous_even_and_refuses_empty_stages() -> None:
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]  # 7 = 3 + 2 + 2
    with pytest.raises(ValueError, match="3 layers cannot fill 4"):
        split_layers(3, 4)


def test_micro_batches_cover_the_local_batch_in_order() -> None:
    assert micro_batches(4, 2) == [(0, 2), (2, 2)]
    assert micro_batches(3, 2) == [(0, 2), (2, 1)]  # a reduced replica
    assert micro_batches(2, 4) == [(0, 1), (1, 1)]  # never an empty micro-batch


@given(st.lists(st.integers(1, 6), min_size=2, max_size=5))
def test_every_rank_gets_its_input_and_every_gradient_reaches_its_sender(degrees: list[int]) -> None:
    for s in range(len(degrees)):
        for j in range(degrees[s]):
            p = activation_peers(degrees, s, j)
            if s > 0:  # the input comes from j mod tp_{s-1}, which lists j among its receivers
                assert p.recv_input == j % degrees[s - 1]
                assert j in activation_peers(degrees, s - 1, p.recv_input).send_output
            if s < len(degrees) - 1:  # the gradient comes from j mod tp_{s+1}, which lists j
                assert p.recv_grad == j % degrees[s + 1]
                assert j in activation_peers(degrees, s + 1, p.recv_grad).send_grad
    for s in range(len(degrees) - 1):  # each stage-(s+1) rank has exactly one sender
        sent = [k for j in range(degrees[s]) for k in activation_peers(degrees, s, j).send_output]
        assert sorted(sent) == list(range(degrees[s + 1]))


def simulate(kinds: list[str], n_micro: int) -> list[list[Op]]:
    """Run every stage's schedule (stage s runs `kinds[s]`) as the ranks do: sends never block,
    F(k) of stage s > 0 waits for the next activation message from s-1 and B(k) of a stage before
    the last for the next gradient message from s+1, each direction of each stage pair a FIFO (as
    gloo's messages between two ranks of one group). Returns what each stage ran; asserts that every
    message a stage receives is the micro-batch it is about to run, and that nothing deadlocks."""
    n = len(kinds)
    todo = [schedule_ops(k, n, s, n_micro) for s, k in enumerate(kinds)]
    acts: list[list[int]] = [[] for _ in range(n)]  # acts[s]: messages from s-1 not yet received
    grads: list[list[int]] = [[] for _ in range(n)]  # grads[s]: messages from s+1 not yet received
    ran: list[list[Op]] = [[] for _ in range(n)]
    while any(todo):
        moved = False
        for s in range(n):
            if not todo[s]:
                continue
            what, k = todo[s][0]
            queue = acts[s] if what == "F" and s > 0 else grads[s] if what == "B" and s < n - 1 else None
            if queue is not None:
                if not queue:
                    continue  # blocked on its receive
                got = queue.pop(0)
                assert got == k, f"stage {s} runs {what}{k} with the message of micro-batch {got}"
            todo[s].pop(0)
            ran[s].append((what, k))
            if what == "F" and s < n - 1:
                acts[s + 1].append(k)
            if what == "B" and s > 0:
                grads[s - 1].append(k)
            moved = True
        assert moved, f"deadlock: {[t[0] for t in todo if t]} all wait for a message"
    return ran


@given(st.integers(1, 8), st.integers(1, 16), st.sampled_from(SCHEDULES))
def test_schedules_complete_pair_messages_and_keep_what_they_promise(n_stages: int, n_micro: int, kind: str) -> None:
    ran = simulate([kind] * n_stages, n_micro)
    for s, ops in enumerate(ran):
        assert sorted(ops) == sorted([("F", k) for k in range(n_micro)] + [("B", k) for k in range(n_micro)])
        assert all(ops.index(("F", k)) < ops.index(("B", k)) for k in range(n_micro))
        # GPipe keeps every micro-batch alive; 1F1B at most as many as the stages from here on
        assert peak_live(ops) == (n_micro if kind == "gpipe" else min(n_stages - s, n_micro)), (s, ops)


def test_1f1b_warms_up_alternates_and_cools_down() -> None:
    # PP4, 6 micro-batches: stage 0 runs 3 forwards ahead, the last stage none
    f, b = "F", "B"
    assert schedule_ops("1f1b", 4, 0, 6) == [(f, 0), (f, 1), (f, 2), (f, 3), (b, 0), (f, 4), (b, 1), (f, 5), (b, 2),
                                             (b, 3), (b, 4), (b, 5)]
    assert schedule_ops("1f1b", 4, 3, 6) == [x for k in range(6) for x in ((f, k), (b, k))]
    assert schedule_ops("1f1b", 4, 0, 2) == [(f, 0), (f, 1), (b, 0), (b, 1)]  # fewer micro-batches than stages
    assert schedule_ops("gpipe", 2, 0, 3) == [(f, 0), (f, 1), (f, 2), (b, 2), (b, 1), (b, 0)]
    with pytest.raises(ValueError, match="schedule must be one of 1f1b, gpipe"):
        schedule_ops("interleaved", 2, 0, 2)


def test_stages_on_different_schedules_would_pair_the_wrong_micro_batches() -> None:
    """Why the activation header carries the schedule and the micro-batch (pipeline.Tag): with one
    stage on GPipe and the next on 1F1B the gradients of equal shapes come back in another order."""
    with pytest.raises(AssertionError, match="with the message of micro-batch"):
        simulate(["gpipe", "1f1b"], 3)


def simulate_blocking(degrees: list[int], kind: str, n_micro: int,
                      steps_of: Callable[[str, int, int, int], list[Step]] = stage_steps) -> None:
    """Every rank of a replica whose stages have TP `degrees` runs its `steps_of` (the runtime's:
    `stage_steps`) with the messages `comm_phases` gives it, sends modelled as NCCL's can block: a
    group of messages posted together completes only once each message's counterpart has been
    posted by the peer (a send's receive, a receive's send), and a rank posts nothing more until
    its group completes (NCCL runs a rank's point-to-point groups in order). Each operation is a
    barrier of its stage's ranks (their TP all-reduces). Each (sender, receiver) channel pairs its
    messages in order; asserts that every receive gets the message it expects and that no rank
    ever waits for good (a send whose receive the peer would post only after it)."""
    n = len(degrees)
    ranks = [[sum(degrees[:s]) + j for j in range(d)] for s, d in enumerate(degrees)]
    # each rank's program: ("msgs", [Msg...]) groups and ("op", stage, Op) barriers
    prog: dict[int, list[tuple[str, Any]]] = {}
    for s in range(n):
        for j, r in enumerate(ranks[s]):
            links = StageLinks.of(ranks, s, j, None)
            prog[r] = []
            for step in steps_of(kind, n, s, n_micro):
                if isinstance(step, Comm):
                    prog[r] += [("msgs", g) for g in comm_phases(step, links) if g]
                else:
                    prog[r].append(("op", (s, step)))
    pos = dict.fromkeys(prog, 0)
    matched: dict[int, set[int]] = {r: set() for r in prog}  # message indices of the current group
    sends: dict[tuple[int, int], list[tuple[int, int, str, int]]] = {}  # (src, dst) -> posted, unmatched
    recvs: dict[tuple[int, int], list[tuple[int, int, str, int]]] = {}

    def post(r: int) -> None:
        if pos[r] < len(prog[r]) and prog[r][pos[r]][0] == "msgs":
            for i, (send, peer, what, k) in enumerate(prog[r][pos[r]][1]):
                ch = (r, peer) if send else (peer, r)
                (sends if send else recvs).setdefault(ch, []).append((r, i, what, k))

    for r in prog:
        post(r)
    while any(pos[r] < len(prog[r]) for r in prog):
        moved = False
        for ch in list(sends):  # pair the posted messages of each channel, in order
            while sends.get(ch) and recvs.get(ch):
                (sr, si, sw, sk), (rr, ri, rw, rk) = sends[ch].pop(0), recvs[ch].pop(0)
                assert (sw, sk) == (rw, rk), f"rank {rr} receives {rw}{rk} from {ch[0]}, which sent {sw}{sk}"
                matched[sr].add(si)
                matched[rr].add(ri)
                moved = True
        for r in prog:
            if pos[r] >= len(prog[r]):
                continue
            what, body = prog[r][pos[r]]
            if what == "msgs":
                done = len(matched[r]) == len(body)
            else:  # an operation: every rank of the stage is at it
                s = body[0]
                done = all(pos[q] < len(prog[q]) and prog[q][pos[q]] == ("op", body) for q in ranks[s])
            if done:
                if what == "op":  # the whole stage passes the barrier together
                    for q in ranks[body[0]]:
                        pos[q] += 1
                        post(q)
                else:
                    matched[r] = set()
                    pos[r] += 1
                    post(r)
                moved = True
        stuck = {r: prog[r][pos[r]] for r in prog if pos[r] < len(prog[r])}
        assert moved, f"deadlock: {stuck}"
    assert not any(sends.values()) and not any(recvs.values())


def _apart(kind: str, n_stages: int, stage: int, n_micro: int) -> list[Step]:
    """The order before the fix: an operation's sends posted on their own right after it, the
    next operation's receive on its own."""
    out: list[Step] = []
    for step in stage_steps(kind, n_stages, stage, n_micro):
        if isinstance(step, Comm):
            out += [c for c in (Comm(send_out=step.send_out, send_grad=step.send_grad),
                                Comm(recv_grad=step.recv_grad, recv_in=step.recv_in)) if c != Comm()]
        else:
            out.append(step)
    return out


@given(st.lists(st.integers(1, 3), min_size=1, max_size=5), st.integers(1, 9), st.sampled_from(SCHEDULES))
def test_schedules_complete_when_sends_block_as_on_nccl(degrees: list[int], n_micro: int, kind: str) -> None:
    simulate_blocking(degrees, kind, n_micro)


def test_sends_posted_apart_from_the_next_receive_deadlock_1f1b_when_sends_block() -> None:
    """The negative control: with each send posted before the peer's matching receive, 1F1B's
    steady state hangs (stage s sends output k, then wants gradient i; stage s+1 sends gradient i,
    then wants input k), as it did on NCCL; GPipe's order happens to survive it."""
    with pytest.raises(AssertionError, match="deadlock"):
        simulate_blocking([1, 1], "1f1b", 2, _apart)
    with pytest.raises(AssertionError, match="deadlock"):
        simulate_blocking([2, 1, 2], "1f1b", 6, _apart)
    simulate_blocking([1, 1, 1], "gpipe", 4, _apart)
    # the schedule's steps: every comm carries the previous operation's sends and the next one's receive
    assert stage_steps("1f1b", 2, 0, 2) == [("F", 0), Comm(send_out=0), ("F", 1), Comm(send_out=1, recv_grad=0),
                                            ("B", 0), Comm(recv_grad=1), ("B", 1)]
    assert stage_steps("1f1b", 2, 1, 2) == [Comm(recv_in=0), ("F", 0), ("B", 0), Comm(send_grad=0, recv_in=1),
                                            ("F", 1), ("B", 1), Comm(send_grad=1)]
    links = StageLinks.of([[0, 1], [2]], 0, 0, None)  # stage 0 at TP2 sends to stage 1's only rank
    msgs: list[list[Msg]] = comm_phases(Comm(send_out=3, recv_grad=2), links)
    assert msgs == [[(True, 2, "head", 3), (True, 2, "act", 3), (False, 2, "grad", 2)]]


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_stages_compose_to_the_whole_model(name: str, stages: int) -> None:
    torch.manual_seed(0)
    whole = pj.build(name)
    idx = torch.randint(0, pj.VOCAB, (3, pj.SEQ))
    expect = pj.logits(whole, idx)
    x = idx
    names = []
    for s in range(stages):
        part = stage_module(whole, s, stages)
        x = part(x)
        names += [n for n, _ in part.named_parameters()]
    assert torch.equal(x, expect)
    # every parameter in exactly one stage, under its name in the whole model
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())


def test_a_stage_plan_keeps_the_families_it_uses() -> None:
    torch.manual_seed(0)
    whole = pj.build("gpt")
    plan = plan_for(whole)
    middle = stage_plan(plan, stage_module(whole, 1, 3))
    assert dict(middle.units) == {"heads": 4, "mlp": 24}  # type: ignore[attr-defined]
    assert not any(p in middle for p in ("tok", "head"))
    assert dict(stage_plan(plan, stage_module(whole, 2, 3)).units) == {"heads": 4, "mlp": 24, "vocab": 32}  # type: ignore[attr-defined]


def test_tied_embeddings_across_stages_are_refused() -> None:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, tie_word_embeddings=True)
    m = tf.LlamaForCausalLM(cfg)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    with pytest.raises(ValueError, match="tied weight"):
        stage_module(m, 0, 2)
    stage_module(m, 0, 1)  # one stage holds both: nothing to refuse


def test_unknown_models_are_refused() -> None:
    with pytest.raises(ValueError, match="no pipeline split for Sequential"):
        stage_module(nn.Sequential(nn.Linear(2, 2)), 0, 2)


def _saved_bytes_and_grads(model: nn.Module, stages: int, idx: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for the backward of the stages' forward (parameters not counted), and
    the gradients."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    parts = [stage_module(model, s, stages) for s in range(stages)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = idx if parts else pj.logits(model, idx)  # no stages: the whole model's own forward
        for part in parts:
            x = part(x)
    torch.nn.functional.cross_entropy(x.flatten(0, 1), idx.flatten()).backward()
    return sum(seen.values()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("stages", [0, 2])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_recomputation_keeps_less_and_gives_the_same_gradients(name: str, stages: int) -> None:
    """The model's own switch (HF's activation checkpointing, TinyGpt's flag) reaches the whole
    model's forward (stages 0) and the pipeline's stages: they keep fewer bytes for the backward,
    and the gradients are bitwise those without."""
    idx = torch.randint(0, pj.VOCAB, (3, pj.SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    plain_bytes, plain = _saved_bytes_and_grads(pj.build(name), stages, idx)
    torch.manual_seed(0)
    model = pj.build(name)
    assert enable_recompute(model)
    rc_bytes, rc = _saved_bytes_and_grads(model, stages, idx)
    assert rc_bytes < plain_bytes / 2, (rc_bytes, plain_bytes)
    assert plain.keys() == rc.keys() and all(torch.equal(plain[n], rc[n]) for n in plain)


def test_recomputation_of_a_model_without_a_switch_is_refused() -> None:
    with pytest.raises(RecomputeError, match="Sequential has no activation-checkpointing switch"):
        enable_recompute(nn.Sequential(nn.Linear(2, 2)))
