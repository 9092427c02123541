"""Unmodified Hugging Face models under `plan_for` + `parallelize`, real processes on gloo.

For Llama (MHA, GQA with a padding token), Mistral, Qwen2 (biases), Qwen3 (separate head_dim) and
GPT-2 (Conv1D, fused q|k|v), each with tied and untied embeddings:

- TP 1-4, contiguous and non-contiguous units: logits, loss, every gradient and the parameters
  after one SGD (momentum) and one AdamW step equal the unsharded model's (fp32, rel. <= 1e-5),
  and greedy `generate()` with the KV cache gives the same tokens;
- the NTP gradient sync between a TP1 and a TP3 replica with different local batches, then a
  step: the parameters equal one process trained on the global batch;
- kill -> TP3 -> rejoin: a step at TP4 + TP1, one rank fails, the survivors reshard (parameters
  and optimizer state) to TP3 + TP1 and step, the rank comes back as a fresh model, everyone
  reshards to TP4 + TP1 and steps: every rank's parameters (the returning one's too) equal the
  reference, and tied weights are still one Parameter (also in the optimizer).

All of it runs in one set of 5 processes (module fixture): starting processes that import torch
and transformers costs more than every case together. The kill -> TP3 -> rejoin run with real
process deaths is in test_hf_runtime.py."""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (the dev extra)")

from ntp_manager.worker import plan_for
from ntp_manager.worker.reshard import apply_reshard
from ntp_manager.worker.runtime import ensure_optimizer_state
from ntp_manager.worker.sync import NtpGradSync, SyncLayout, families_of, replicas_from
from ntp_manager.worker.tp import ShardedModule, parallelize
from tests.fakes.procs import free_port, worker_context
from tests.worker.hf_models import (
    SPECS,
    build,
    err,
    exact_zero_grad,
    make_opt,
    pairs,
    rel,
    tied_ok,
    tokens,
    unit_lists,
)

WORLD = 5
TOL = 1e-5
TP_MODES = [(1, "contiguous"), (2, "contiguous"), (3, "contiguous"), (4, "contiguous"), (2, "non-contiguous"),
            (3, "non-contiguous"), (4, "non-contiguous")]
MODELS = [(s, t) for s in SPECS for t in (False, True)]


def _id(spec: str, tied: bool) -> str:
    return f"{spec}-{'tied' if tied else 'untied'}"


# ---- the cases, run inside the worker processes ---------------------------------------------------
def _equivalence(spec: str, tied: bool, tp: int, mode: str, rank: int, group: Any) -> dict[str, float]:
    ref, model = build(spec, tied), build(spec, tied)
    plan = plan_for(model)
    parallelize(model, plan, unit_lists(dict(plan.units), tp, mode)[rank], group=group)
    errs: dict[str, float] = {"tied": 0.0 if tied_ok(model, tied) else 1.0}
    if mode == "non-contiguous":  # greedy generation with the KV cache: the same tokens
        prompt = tokens(1, 2)[0][:, :4]
        kw: dict[str, Any] = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        same = torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
        errs["generate"] = 0.0 if same else 1.0
    ids, labels = tokens(0, 3, pad=spec == "llama-gqa")
    out, rout = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    errs["logits"], errs["loss"] = rel(out.logits.detach(), rout.logits.detach()), rel(out.loss.detach(), rout.loss)
    out.loss.backward()
    rout.loss.backward()
    ps = list(pairs(model, ref))
    for name, p, r, part in ps:
        assert p.grad is not None and r.grad is not None, name
        errs[f"grad {name}"] = err(name, p.grad, part(r.grad))
    if spec == "llama-gqa":  # the padding row: no gradient from its lookups (untied: none at all)
        emb = model.get_input_embeddings()
        row = emb.local_padding_idx
        if row is not None and not tied:
            errs["padding row grad"] = float(emb.weight.grad[row].abs().max())
    saved = [(p.detach().clone(), r.detach().clone()) for _, p, r, _ in ps]
    for kind in ("sgd", "adamw"):
        with torch.no_grad():
            for (_, p, r, _), (a, b) in zip(ps, saved, strict=True):
                p.copy_(a)
                r.copy_(b)
        make_opt(kind, model.parameters()).step()
        make_opt(kind, ref.parameters()).step()
        for name, p, r, part in ps:
            if kind == "adamw" and exact_zero_grad(name):
                continue
            errs[f"{kind} step {name}"] = err(name, p.detach(), part(r.detach()))
    return errs


def _reference_steps(spec: str, tied: bool, kind: str, batches: list[int]) -> Any:
    ref = build(spec, tied)
    opt = make_opt(kind, ref.parameters())
    for s, gb in enumerate(batches):
        opt.zero_grad()
        ref(input_ids=tokens(s, gb)[0], labels=tokens(s, gb)[1]).loss.backward()
        opt.step()
    return ref


def _sync(spec: str, tied: bool, rank: int, groups: dict[tuple[int, ...], Any]) -> dict[str, float]:
    """TP1 (local batch 1) + TP3 (local batch 3): sync degree 1, the TP3 replica's extras send
    their units to its core; then one AdamW step. Rank 4 is not in the layout."""
    replicas, batches = [[0], [1, 2, 3]], [1, 3]
    model = build(spec, tied)
    plan = plan_for(model)
    lay = SyncLayout(replicas_from(replicas, batches), dict(plan.units))
    if rank == 4:  # not in this layout: it only takes part in creating the sync's groups
        NtpGradSync(model, lay, rank, families_of(plan, model)).release()
        return {}
    ri, _ = lay.locate(rank)
    parallelize(model, plan, lay.units_of(rank), group=groups[tuple(replicas[ri])])
    sync = NtpGradSync(model, lay, rank, families_of(plan, model))
    opt = make_opt("adamw", model.parameters())
    ids, labels = tokens(0, sum(batches))
    a = sum(batches[:ri])
    sync.zero_grad()
    model(input_ids=ids[a : a + batches[ri]], labels=labels[a : a + batches[ri]]).loss.backward()
    sync.sync()
    ref = build(spec, tied)
    ref(input_ids=ids, labels=labels).loss.backward()
    errs = {f"grad {n}": err(n, p.grad, part(r.grad)) for n, p, r, part in pairs(model, ref)}
    opt.step()
    make_opt("adamw", ref.parameters()).step()
    errs |= {f"step {n}": err(n, p.detach(), part(r.detach())) for n, p, r, part in pairs(model, ref)
             if not exact_zero_grad(n)}
    errs["tied"] = 0.0 if tied_ok(model, tied) else 1.0
    sync.release()
    return errs


def _per_token(rank: int, groups: dict[tuple[int, ...], Any]) -> dict[str, float]:
    """Padded samples, so samples count different numbers of tokens; TP1 (1 sample) + TP3 (3).
    The sync weights each replica's loss by its samples; with HF's default loss (a mean over the
    local batch's tokens) that is not one process's mean over the global batch's tokens. Scaling
    each replica's token sum as docs/worker.md says (HF: num_items_in_batch = the global batch's
    counted tokens x local batch / global batch) is. Returns the worst gradient error of each."""
    replicas, batches = [[0], [1, 2, 3]], [1, 3]
    ids, labels = tokens(0, 4, pad=True)
    counted = int((labels[:, 1:] != -100).sum())  # HF shifts: position t predicts token t + 1
    ref = build("llama-gqa", True)
    ref(input_ids=ids, labels=labels).loss.backward()
    out = {}
    for how in ("local token mean", "global token mean"):
        model = build("llama-gqa", True)
        plan = plan_for(model)
        lay = SyncLayout(replicas_from(replicas, batches), dict(plan.units))
        if rank == 4:  # not in this layout: it only takes part in creating the sync's groups
            NtpGradSync(model, lay, rank, families_of(plan, model)).release()
            continue
        ri, _ = lay.locate(rank)
        parallelize(model, plan, lay.units_of(rank), group=groups[tuple(replicas[ri])])
        sync = NtpGradSync(model, lay, rank, families_of(plan, model))
        a, b = sum(batches[:ri]), batches[ri]
        sync.zero_grad()
        kw = {"num_items_in_batch": counted * b / sum(batches)} if how == "global token mean" else {}
        model(input_ids=ids[a : a + b], labels=labels[a : a + b], **kw).loss.backward()
        sync.sync()
        out[how] = max(err(n, p.grad, part(r.grad)) for n, p, r, part in pairs(model, ref))
        sync.release()
    return out


def _send_replicated(model: Any, opt: Any, src: int) -> None:
    """What the runtime gives a joining rank besides its shards (Runtime._send_replicated): the
    replicated parameters with their optimizer state, and Adam's step count."""
    sharded = {id(p) for m in model.modules() if isinstance(m, ShardedModule) for _, p, _ in m.sharded_params()}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in sharded:
                dist.broadcast(p.data, src=src)
                st = opt.state.get(p, {})
                for k in sorted(st):
                    if isinstance(st[k], torch.Tensor) and st[k].dim() > 0:
                        dist.broadcast(st[k], src=src)
    step = torch.tensor([-1.0], dtype=torch.float64)
    if dist.get_rank() == src:
        step[0] = float(next((st["step"] for st in opt.state.values() if "step" in st), -1.0))
    dist.broadcast(step, src=src)
    for st in opt.state.values():
        if "step" in st:
            st["step"] = torch.tensor(step.item())


def _kill_tp3_rejoin(spec: str, tied: bool, kind: str, rank: int, groups: dict[tuple[int, ...], Any]
                     ) -> dict[str, float]:
    """Step 0 at TP4 + TP1; rank 3 fails; the survivors reshard to TP3 + TP1 (rank 3's units come
    from the TP1 replica, with their optimizer state) and take step 1; rank 3 comes back as a
    fresh process (a model built from another seed, so that anything not sent to it shows),
    everyone reshards to TP4 + TP1 and takes step 2."""
    model = build(spec, tied)
    plan = plan_for(model)
    units = dict(plan.units)
    l0 = SyncLayout(replicas_from([[0, 1, 2, 3], [4]], [4, 1]), units)
    l1 = SyncLayout(replicas_from([[0, 1, 2], [4]], [3, 1]), units)
    fams = families_of(plan, model)
    tp_group = {0: (0, 1, 2, 3), 1: (0, 1, 2), 2: (0, 1, 2, 3)}
    mine = {s: groups[tp_group[s] if rank < 4 else (4,)] for s in tp_group}
    parallelize(model, plan, l0.units_of(rank), group=mine[0])
    opt = make_opt(kind, model.parameters())
    errs: dict[str, float] = {}
    alive = {0, 1, 2, 4}
    for step, (old, lay) in enumerate([(l0, l0), (l0, l1), (l1, l0)]):
        if step == 1:  # rank 3 fails
            opt = apply_reshard(model, opt, old, lay, alive, rank, fams, mine[1])
        if step == 2:  # rank 3 rejoins with nothing but a freshly built model
            if rank == 3:
                model = build(spec, tied, seed=99)
                parallelize(model, plan, lay.units_of(rank), group=mine[2])
                opt = make_opt(kind, model.parameters())
                ensure_optimizer_state(opt)
            opt = apply_reshard(model, opt, old, lay, alive, rank, fams, mine[2])
            _send_replicated(model, opt, src=0)
        if step and plan.fixup is not None:
            plan.fixup(model)  # what the Runtime does after a reshard (GPT-2's split width)
        sync = NtpGradSync(model, lay, rank, fams)  # every rank: it creates groups
        if sync.active:
            ri, _ = lay.locate(rank)
            a, n = sum(r.local_batch for r in lay.replicas[:ri]), lay.replicas[ri].local_batch
            ids, labels = tokens(step, lay.global_batch)
            sync.zero_grad()
            model(input_ids=ids[a : a + n], labels=labels[a : a + n]).loss.backward()
            sync.sync()
            opt.step()
        sync.release()
    ref = _reference_steps(spec, tied, kind, [5, 4, 5])
    for name, p, r, part in pairs(model, ref):
        if kind == "adamw" and exact_zero_grad(name):
            continue
        errs[f"param {name}"] = err(name, p.detach(), part(r.detach()))
    errs["tied"] = 0.0 if tied_ok(model, tied) else 1.0
    in_opt = [id(p) for p in opt.param_groups[0]["params"]]
    errs["optimizer holds the model's parameters once"] = 0.0 if (
        set(in_opt) == {id(p) for p in model.parameters()} and len(set(in_opt)) == len(in_opt)) else 1.0
    return errs


def _worker(rank: int, port: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a collective that cannot complete fails the test instead of hanging it
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=dt.timedelta(seconds=120))
    # every group any case uses, created once by every rank in the same order
    ranks = [(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (1, 2, 3), (4,)]
    groups = {r: dist.new_group(list(r)) for r in ranks}
    out: dict[str, dict[str, float]] = {}
    try:
        for spec, tied in MODELS:
            for tp, mode in TP_MODES:
                if rank < tp:
                    out[f"{_id(spec, tied)}-tp{tp}-{mode}"] = _equivalence(spec, tied, tp, mode, rank,
                                                                           groups[tuple(range(tp))])
            out[f"{_id(spec, tied)}-sync"] = _sync(spec, tied, rank, groups)
            for kind in ("sgd", "adamw"):
                out[f"{_id(spec, tied)}-rejoin-{kind}"] = _kill_tp3_rejoin(spec, tied, kind, rank, groups)
        out["per-token"] = _per_token(rank, groups)
        q.put((rank, out, None))
    except Exception:  # the parent reports it instead of waiting for results that never come
        import traceback

        q.put((rank, out, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, float]]]:
    q = worker_context().SimpleQueue()
    ctx = mp.start_processes(_worker, args=(free_port(), q), nprocs=WORLD, join=False, start_method="forkserver")
    got = [q.get() for _ in range(WORLD)]  # every rank answers, with its results or its traceback
    while not ctx.join():
        pass
    errors = [tb for _, _, tb in got if tb]
    assert not errors, errors[0]
    merged: dict[str, list[dict[str, float]]] = {}
    for _, out, _ in got:
        for case, errs in out.items():
            merged.setdefault(case, []).append(errs)
    return merged


def _worst(per_rank: list[dict[str, float]]) -> tuple[str, float]:
    return max(((k, v) for errs in per_rank for k, v in errs.items()), key=lambda kv: kv[1])


@pytest.mark.parametrize(("tp", "mode"), TP_MODES)
@pytest.mark.parametrize(("spec", "tied"), MODELS, ids=[_id(s, t) for s, t in MODELS])
def test_forward_backward_and_one_step_match_the_unsharded_model(results: Any, spec: str, tied: bool, tp: int,
                                                                 mode: str) -> None:
    per_rank = results[f"{_id(spec, tied)}-tp{tp}-{mode}"]
    assert len(per_rank) == tp
    name, err = _worst(per_rank)
    assert err <= TOL, (name, err)
    assert any(k.startswith("adamw step") for k in per_rank[0]) and any(k.startswith("grad") for k in per_rank[0])
    assert ("generate" in per_rank[0]) == (mode == "non-contiguous")


@pytest.mark.parametrize(("spec", "tied"), MODELS, ids=[_id(s, t) for s, t in MODELS])
def test_ntp_sync_between_tp1_and_tp3_matches_one_process(results: Any, spec: str, tied: bool) -> None:
    per_rank = [e for e in results[f"{_id(spec, tied)}-sync"] if e]  # rank 4 is not in that layout
    assert len(per_rank) == 4
    name, err = _worst(per_rank)
    assert err <= TOL, (name, err)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize(("spec", "tied"), MODELS, ids=[_id(s, t) for s, t in MODELS])
def test_kill_tp3_rejoin_keeps_tied_weights_and_matches(results: Any, spec: str, tied: bool, kind: str) -> None:
    per_rank = results[f"{_id(spec, tied)}-rejoin-{kind}"]
    assert len(per_rank) == WORLD  # the rank that failed and came back too
    name, e = _worst(per_rank)
    assert e <= TOL, (name, e)


def test_per_token_loss_needs_the_documented_normalisation(results: Any) -> None:
    """docs/worker.md, "Loss averaging": with samples of different token counts, the plain
    per-token mean of each replica's batch is measurably off; the documented scaling is exact."""
    per_rank = [e for e in results["per-token"] if e]  # rank 4 is not in that layout
    assert len(per_rank) == 4
    assert max(e["global token mean"] for e in per_rank) <= TOL
    assert max(e["local token mean"] for e in per_rank) > 1e-3


# ---- the plans themselves (this process; no group) ------------------------------------------------
def test_plans_derive_units_from_the_config() -> None:
    gqa = plan_for(build("llama-gqa", True))
    assert gqa.kind == "llama" and dict(gqa.units) == {"heads": 4, "mlp": 40, "vocab": 64}
    q, k, o = (gqa[f"model.layers.*.self_attn.{n}"] for n in ("q_proj", "k_proj", "o_proj"))
    assert (q.unit_size, k.unit_size, o.unit_size) == (2 * 8, 8, 2 * 8)  # 2 query heads per KV group, head_dim 8
    qwen3 = plan_for(build("qwen3", False))  # head_dim 16 from the config, not 64 / 8
    assert qwen3["model.layers.*.self_attn.q_proj"].unit_size == 2 * 16
    assert type(qwen3["model.layers.*.self_attn.q_norm"]).__name__ == "ReplicatedPerUnit"
    gpt2 = plan_for(build("gpt2", True))
    assert dict(gpt2.units) == {"heads": 4, "mlp": 40, "vocab": 64} and gpt2.fixup is not None
    assert gpt2["transformer.h.*.attn.c_attn"].parts == 3 and "transformer.wpe" not in gpt2


def test_plans_refuse_what_they_do_not_cover() -> None:
    import transformers as tf

    cls = tf.LlamaForSequenceClassification(build("llama-mha", False).config)
    with pytest.raises(ValueError, match=r"^score \(Linear\) is not covered by the llama plan"):
        plan_for(cls)
    with pytest.raises(ValueError, match=r"dropout \(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1"):
        plan_for(tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4)))
    with pytest.raises(ValueError, match="add_cross_attention=True has no ready plan"):
        plan_for(tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                                  add_cross_attention=True)))
    llama = build("llama-mha", True)
    llama.model.layers[0].self_attn.extra_gate = torch.nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.extra_gate \(Linear\) is not covered"):
        plan_for(llama)
