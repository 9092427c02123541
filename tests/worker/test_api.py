"""The public API of `ntp_manager.worker`, and what `plan_for` / `parallelize` refuse (one
process: the TP group is this process alone, so every shard holds every unit or the listed ones)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import ntp_manager.worker as worker
from ntp_manager.worker import (
    ColwiseUnits,
    ModelPlan,
    RowwiseUnits,
    parallelize,
    plan_for,
    worker_env,
)
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt

PUBLIC = ["parallelize", "Runtime", "RuntimeConfig", "plan_for", "ModelPlan", "ColwiseUnits", "RowwiseUnits",
          "ReplicatedPerUnit", "ShardStyle", "ShardedModule", "GrpcLayoutSource", "StoreLayoutSource",
          "LayoutSource", "WorkerLayout", "publish_layout", "SyncLayout", "ReplicaGroup", "NtpGradSync",
          "apply_reshard", "reshard_moves", "ReconfigurationError", "StepResult", "TimelineEvent", "WorkerEnv",
          "worker_env", "unit_counts", "families_of", "Checkpointer", "CheckpointError", "RestoreInfo", "Retention",
          "retention_plan", "Pipeline", "stage_module", "split_layers", "OptimizerError", "PrecisionError",
          "RecomputeError", "MapSource", "TokenStream", "SampleSource", "DataSourceError"]


def test_the_public_names_import() -> None:
    assert sorted(PUBLIC) == sorted(worker.__all__)
    for name in PUBLIC:
        assert getattr(worker, name) is not None, name
    with pytest.raises(AttributeError):
        worker.no_such_name  # noqa: B018
    # `from ntp_manager.worker import *` and the lazy loading in a fresh interpreter
    code = ("import sys; import ntp_manager.worker as w; assert 'torch' not in sys.modules; "
            "from ntp_manager.worker import *; assert callable(parallelize) and Runtime.__name__ == 'Runtime'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_worker_env_outside_ntp_run_names_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match="not started by ntp-run: NTP_STORE, NTP_JOB, NTP_WORKER_ID not set"):
        worker_env({})
    with pytest.raises(RuntimeError, match="host:port"):
        worker_env({"NTP_STORE": "nope", "NTP_JOB": "j", "NTP_WORKER_ID": "w"})


CFG = GptConfig(vocab=32, seq=8, d_model=24, heads=4, mlp=40, layers=1)


def test_plan_for_tiny_gpt_is_its_own_plan() -> None:
    plan = plan_for(TinyGpt(CFG))
    assert isinstance(plan, ModelPlan) and plan.kind == "tiny_gpt"
    assert dict(plan.units) == {"heads": 4, "mlp": 40, "vocab": 32}
    assert plan["blocks.*.attn.q"] == ColwiseUnits("heads", 6)


def test_plan_for_refuses_models_it_does_not_know_and_layers_it_does_not_cover() -> None:
    with pytest.raises(ValueError, match=r"no ready plan for Linear \(model_type None\)"):
        plan_for(nn.Linear(4, 4))
    m = TinyGpt(CFG)
    m.blocks[0].attn.extra = nn.Linear(24, 24)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.extra \(Linear\) is not covered by the tiny_gpt plan"):
        plan_for(m)
    m = TinyGpt(CFG)
    m.blocks[0].attn.scale = nn.LayerNorm(6)  # type: ignore[union-attr]  # parameters beside sharded layers
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.scale \(LayerNorm\) is not covered.*partial"):
        plan_for(m)
    sharded = parallelize(TinyGpt(CFG), plan_for(TinyGpt(CFG)), {"heads": [0], "mlp": [0], "vocab": [0]})
    with pytest.raises(ValueError, match="sharded already"):
        plan_for(sharded)


def test_padding_row_gets_no_gradient_from_lookups_as_in_torch() -> None:
    full = nn.Embedding(10, 3, padding_idx=4)
    ref = nn.Embedding(10, 3, padding_idx=4)
    ref.load_state_dict(full.state_dict())
    holder = nn.Module()
    holder.emb = full
    parallelize(holder, {"emb": RowwiseUnits("vocab")}, {"vocab": [7, 4, 1]})  # padding row held, at local row 1
    tokens = torch.tensor([[4, 1, 4, 7, 2]])
    y = holder.emb(tokens)
    r = ref(tokens)
    assert torch.equal(y[0, [0, 1, 2, 3]], r[0, [0, 1, 2, 3]]) and torch.equal(y[0, 4], torch.zeros(3))
    (y * torch.arange(15.0).view(1, 5, 3)).sum().backward()
    (r * torch.arange(15.0).view(1, 5, 3)).sum().backward()
    g = holder.emb.weight.grad
    assert g is not None and ref.weight.grad is not None
    assert torch.equal(g[1], torch.zeros(3)) and torch.equal(g, ref.weight.grad[[7, 4, 1]])


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied


def test_tied_weights_are_sharded_once_or_refused() -> None:
    m = parallelize(_Tied(), {"emb": RowwiseUnits("vocab"), "head": ColwiseUnits("vocab", gather_output=True)},
                    {"vocab": [3, 1, 9]})
    assert m.emb.weight is m.head.weight and m.emb.weight.shape == (3, 8)
    assert len(list(m.parameters())) == 1
    with pytest.raises(ValueError, match=r"head\.weight is the same Parameter as emb\.weight \(tied weights\), but "
                                         "the plan cuts them differently"):
        parallelize(_Tied(), {"emb": RowwiseUnits("vocab"), "head": ColwiseUnits("words", gather_output=True)},
                    {"vocab": [3, 1, 9], "words": [3, 1, 9]})
    whole = _Tied()
    with pytest.raises(ValueError, match=r"head\.weight is the same Parameter as emb\.weight \(tied weights\), which "
                                         "the plan shards"):
        parallelize(whole, {"emb": RowwiseUnits("vocab")}, {"vocab": [3, 1, 9]})
    assert type(whole.emb) is nn.Embedding and whole.emb.weight is whole.head.weight  # left as it was
    with pytest.raises(ValueError, match="out of range"):
        parallelize(whole, {"emb": RowwiseUnits("vocab"), "head": ColwiseUnits("vocab")}, {"vocab": [3, 16]})
    assert type(whole.emb) is nn.Embedding and type(whole.head) is nn.Linear


def test_a_subclass_that_overrides_forward_is_refused() -> None:
    class Scaled(nn.Embedding):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 8.0

    holder = nn.Module()
    holder.emb = Scaled(10, 4)
    with pytest.raises(ValueError, match=r"emb \(Scaled\) overrides nn\.Embedding\.forward"):
        parallelize(holder, {"emb": RowwiseUnits("vocab")}, {"vocab": [0, 1]})


def test_fused_layers_take_whole_blocks() -> None:
    holder = nn.Module()
    holder.qkv = nn.Linear(8, 3 * 8)
    with pytest.raises(ValueError, match="do not split into 5 equal parts"):
        parallelize(holder, {"qkv": ColwiseUnits("heads", 2, parts=5)}, {"heads": [0]})
    with pytest.raises(ValueError, match="gather_output is for an LM head"):
        parallelize(holder, {"qkv": ColwiseUnits("heads", 2, parts=3, gather_output=True)}, {"heads": [0]})
    ref = nn.Linear(8, 3 * 8)
    ref.load_state_dict(holder.qkv.state_dict())
    parallelize(holder, {"qkv": ColwiseUnits("heads", 2, parts=3)}, {"heads": [3, 0]})
    x = torch.randn(2, 8)
    want = ref(x).view(2, 3, 4, 2)[:, :, [3, 0]].reshape(2, -1)  # q|k|v, each the rank's heads in its order
    assert torch.allclose(holder.qkv(x), want)
