"""A hello's inventory is checked in two ways (service/core/inputs.py): a few cheap tests that pass
the usual inventory, and the full checks that name a bad field. The cheap tests must never pass
what the full checks refuse (else a bad value reaches the store): hypothesis looks for one, with
strings and numbers near every limit. Both paths give the same verdict through `check_hello`."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.contract import limits
from ntp_manager.service.core.errors import InvalidArgument
from ntp_manager.service.core.inputs import GpuInventory, _check_inventory, _plainly_valid, check_hello

EDGE_INTS = st.sampled_from([-1, 0, 1, limits.INT32_MAX - 1, limits.INT32_MAX, limits.INT32_MAX + 1,
                             limits.INT64_MAX, limits.INT64_MAX + 1])
INTS = st.one_of(EDGE_INTS, st.integers(-5, 2**64))
CHARS = st.sampled_from(["a", "Z", "9", "-", "/", " ", "~", "\x7f", "\x00", "\t", "\n", "\x1b", "é", "\ud800", "字"])
TEXTS = st.one_of(st.lists(CHARS, max_size=6).map("".join), st.integers(126, 131).map(lambda n: "x" * n),
                  st.just("GPU-" + "a" * 124), st.text(max_size=8))


@st.composite
def gpus(draw: st.DrawFn) -> GpuInventory:
    def field(usual: object, odd: st.SearchStrategy[object]) -> object:  # mostly usual: one odd field at a time
        return draw(st.one_of(st.just(usual), st.just(usual), odd))

    return GpuInventory(field("GPU-0", TEXTS), field(0, INTS), field("H100", TEXTS),  # type: ignore[arg-type]
                        field(80 << 30, INTS), field(700_000, INTS), field(200_000, INTS), field(700_000, INTS))


def full_verdict(inv: list[GpuInventory]) -> str | None:
    try:
        _check_inventory(inv)
    except (limits.LimitError, InvalidArgument) as e:
        return str(e)
    return None


@settings(max_examples=600, deadline=None)
@given(st.lists(gpus(), min_size=1, max_size=3))
def test_the_cheap_tests_never_pass_what_the_full_checks_refuse(inv: list[GpuInventory]) -> None:
    if _plainly_valid(inv):
        assert full_verdict(inv) is None, inv


ODD_INTS = [-1, 0, 1, 199_999, 700_001, limits.INT32_MAX, limits.INT32_MAX + 1, limits.INT64_MAX, limits.INT64_MAX + 1]
ODD_TEXTS = ["", " ", "a b", "~", "\x7f", "\x00", "\t", "\n", "\x1b", "é", "\ud800", "字", "x" * 128, "x" * 129]
USUAL = GpuInventory("GPU-0", 0, "H100", 80 << 30, 700_000, 200_000, 700_000)


@pytest.mark.parametrize("name", ["uuid", "index", "model", "memory_bytes", "default_mw", "min_mw", "max_mw"])
def test_each_field_at_each_odd_value(name: str) -> None:
    """Every field alone at every value near a limit: the cheap tests pass it only if the full
    checks do (and the usual inventory passes both)."""
    values = ODD_TEXTS if name in ("uuid", "model") else ODD_INTS
    for v in values:
        inv = [GpuInventory(**{**USUAL.__dict__, name: v})]
        if _plainly_valid(inv):
            assert full_verdict(inv) is None, (name, v)


def test_the_usual_inventory_takes_the_cheap_path_and_a_bad_one_is_named() -> None:
    good = [GpuInventory(f"GPU-{i:08x}-aaaa", i, "NVIDIA H100 80GB HBM3", 80 << 30, 700_000, 200_000, 700_000)
            for i in range(8)]
    assert _plainly_valid(good)
    check_hello("node-0", "nvl-0", good, "boot", "1.0")
    for bad, field in (({"uuid": "GPU 1"}, "hello.gpus[3].uuid"), ({"model": "H100\x00"}, "hello.gpus[3].model"),
                       ({"index": -1}, "hello.gpus[3].index"), ({"max_mw": 2**31}, "hello.gpus[3].power.max_mw"),
                       ({"min_mw": 800_000}, "hello.gpus[3].power")):
        inv = [GpuInventory(**{**g.__dict__, **bad}) if i == 3 else g for i, g in enumerate(good)]
        assert not _plainly_valid(inv)
        with pytest.raises(InvalidArgument, match="^" + re.escape(field)):
            check_hello("node-0", "nvl-0", inv, "boot", "1.0")
    # a model outside printable ASCII is valid: the full checks pass it
    fancy = [GpuInventory("GPU-1", 0, "Grâce Hopper\t", 1, 1, 1, 1)]
    assert not _plainly_valid(fancy) and full_verdict(fancy) is None
    check_hello("node-0", "nvl-0", fancy, "boot", "1.0")
