"""Pipeline pieces without processes: the layer split, micro-batches, who sends activations to whom
whatever the stages' TP degrees, stage modules that compose to the whole model exactly (TinyGpt,
HF Llama), the plan restricted to a stage, and the refusals (tied embeddings across stages, too few
layers, unknown models)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ntp_manager.worker.pipeline import activation_peers, micro_batches, split_layers, stage_module, stage_plan
from ntp_manager.worker.plans import plan_for
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
