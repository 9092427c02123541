"""Global rank numbering of pipelines (contract/ranks.py): replica by replica, stage by stage, TP
index by TP index; `locate` inverts `global_rank`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ntp_manager.contract.ranks import check_degrees, global_rank, locate, stage_ranks, world_size


def test_the_documented_example() -> None:
    # replica 0: stage 0 at TP4 (0-3), stage 1 at TP3 (4-6); replica 1: 7-10, 11-14
    deg = ((4, 3), (4, 4))
    assert stage_ranks(deg) == [[range(0, 4), range(4, 7)], [range(7, 11), range(11, 15)]]
    assert world_size(deg) == 15
    assert global_rank(deg, 1, 0, 2) == 9
    assert locate(deg, 6) == (0, 1, 2)
    assert locate(deg, 11) == (1, 1, 0)


@given(st.lists(st.lists(st.integers(1, 5), min_size=3, max_size=3), min_size=1, max_size=4))
def test_locate_inverts_global_rank_and_ranks_are_dense(deg: list[list[int]]) -> None:
    seen = []
    for ri, stages in enumerate(deg):
        for si, d in enumerate(stages):
            for j in range(d):
                r = global_rank(deg, ri, si, j)
                assert locate(deg, r) == (ri, si, j)
                seen.append(r)
    assert seen == list(range(world_size(deg)))  # in order, no gaps


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="same depth"):
        check_degrees([[4, 4], [4]])
    with pytest.raises(ValueError, match=">= 1"):
        check_degrees([[4, 0]])
    with pytest.raises(ValueError, match="at least one replica"):
        check_degrees([])
    with pytest.raises(IndexError):
        global_rank([[2, 2]], 0, 1, 2)
    with pytest.raises(ValueError, match="not in a layout of 4"):
        locate([[2, 2]], 4)
