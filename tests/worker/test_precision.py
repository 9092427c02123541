"""bf16 with fp32 master state (worker/precision.py) without processes: the step's bf16 copies take
the parameters' places and give them fp32 gradients, micro-batches accumulate in fp32, a tied
weight gets one copy, everything is put back even when the step fails; and what is refused at
set-up, naming what and why (fp16, a model not built in fp32 under bf16, modules a Hugging Face
model keeps in fp32, half-precision parameters under fp32, an unknown schedule). The runtime's
bf16 path with real processes, through failures and stage changes: test_pipeline_runtime.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

from ntp_manager.worker.precision import PrecisionError, check_model, check_precision_name, compute_copies
from ntp_manager.worker.runtime import Runtime, RuntimeConfig
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt

BF = torch.bfloat16
CFG = GptConfig(vocab=32, seq=8, d_model=16, heads=4, mlp=32, layers=2)


def _loss(m: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = m(idx)
    return nn.functional.cross_entropy(out.float().flatten(0, 1), idx.flatten())


def test_the_step_runs_on_bf16_copies_and_the_fp32_parameters_get_fp32_gradients() -> None:
    torch.manual_seed(0)
    m = TinyGpt(CFG)
    m.head.weight = m.tok.weight  # tied: one copy, its two uses' gradients in one fp32 .grad
    before = dict(m.named_parameters())
    idx = [torch.randint(0, CFG.vocab, (2, CFG.seq), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    with compute_copies(m, BF):
        assert all(p.dtype == BF for p in m.parameters())
        assert m.head.weight is m.tok.weight  # still one tensor
        for x in idx:  # two micro-batches on the same copies
            _loss(m, x).backward()
    assert dict(m.named_parameters()) == before and all(type(p) is nn.Parameter for p in m.parameters())
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               for p in m.parameters())
    # the same as bf16 copies through torch.func (one cast per micro-batch), the gradients added in fp32
    want: dict[str, torch.Tensor] = {}
    for x in idx:
        copies = {n: p.detach().to(BF).requires_grad_(True) for n, p in m.named_parameters()}
        _loss_f = nn.functional.cross_entropy(functional_call(m, copies, (x,)).float().flatten(0, 1), x.flatten())
        _loss_f.backward()
        for n, c in copies.items():
            assert c.grad is not None
            want[n] = want.get(n, torch.zeros_like(c.grad, dtype=torch.float32)) + c.grad.float()
    got = {n: p.grad for n, p in m.named_parameters()}
    assert all(torch.equal(got[n], want[n]) for n in want), max(
        (float((got[n] - want[n]).abs().max()), n) for n in want)  # type: ignore[operator]


def test_the_parameters_come_back_when_the_step_fails() -> None:
    m = nn.Linear(2, 2)
    w = m.weight
    with pytest.raises(RuntimeError, match="peer died"), compute_copies(m, BF):
        assert m.weight.dtype == BF
        raise RuntimeError("peer died")
    assert m.weight is w


@pytest.mark.parametrize(("precision", "build", "words"), [
    ("bf16", lambda: nn.Linear(2, 2).to(BF), r"parameter\(s\) are built in another dtype \(weight is torch.bfloat16"),
    ("bf16", lambda: nn.Linear(2, 2).double(), "weight is torch.float64"),
    ("fp32", lambda: nn.Linear(2, 2).to(BF), "half-precision parameter.*set precision 'bf16'"),
    ("fp32", lambda: nn.Linear(2, 2).half(), "half-precision parameter"),
])
def test_a_model_that_cannot_train_in_the_precision_is_refused(precision: str, build: Any, words: str) -> None:
    with pytest.raises(PrecisionError, match=words):
        check_model(build(), precision)


def test_modules_a_hugging_face_model_keeps_in_fp32_are_refused_under_bf16() -> None:
    import transformers as tf

    m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                           num_attention_heads=4))
    check_model(m, "bf16")
    m._keep_in_fp32_modules = ["lm_head"]  # as models whose head must stay fp32 declare it
    with pytest.raises(PrecisionError, match=r"keeps lm_head in fp32 \(_keep_in_fp32_modules\)"):
        check_model(m, "bf16")
    check_model(m, "fp32")


def test_fp16_and_unknown_settings_are_refused_in_the_config() -> None:
    with pytest.raises(PrecisionError, match="fp16 gradients underflow without loss scaling"):
        check_precision_name("fp16")
    with pytest.raises(PrecisionError, match="fp16 gradients underflow"):
        RuntimeConfig(job="j", precision="fp16")
    with pytest.raises(PrecisionError, match="precision must be one of fp32, bf16, not 'tf32'"):
        RuntimeConfig(job="j", precision="tf32")
    with pytest.raises(ValueError, match="schedule must be one of 1f1b, gpipe, not 'interleaved'"):
        RuntimeConfig(job="j", schedule="interleaved")
    with pytest.raises(ValueError, match="recompute must be True or False"):
        RuntimeConfig(job="j", recompute="yes")  # type: ignore[arg-type]
    assert RuntimeConfig(job="j").schedule == "1f1b"  # the default


def test_the_runtime_refuses_the_model_when_it_first_builds_it() -> None:
    """Before any group or step: the first model the runtime builds (at start) is checked."""
    rt = Runtime(lambda: TinyGpt(CFG).to(BF), None, lambda p: torch.optim.SGD(p, lr=0.1), None,  # type: ignore[arg-type]
                 None, RuntimeConfig(job="j", precision="bf16"))
    with pytest.raises(PrecisionError, match="build the model in fp32"):
        rt._fresh_model()
    rt = Runtime(lambda: nn.Sequential(nn.Linear(2, 2)), None, lambda p: torch.optim.SGD(p, lr=0.1),
                 None, None, RuntimeConfig(job="j", recompute=True))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Sequential has no activation-checkpointing switch"):
        rt._fresh_model()
