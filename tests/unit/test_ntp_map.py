from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.contract.ntp_map import even_chunks, max_units_per_rank, ntp_map, sync_groups


@st.composite
def shapes(draw):
    n_healthy = draw(st.integers(1, 40))
    n_reduced = draw(st.integers(1, n_healthy))
    units = draw(st.integers(n_healthy, 400))
    return units, n_healthy, n_reduced


@settings(max_examples=400, deadline=None)
@given(shapes())
def test_every_unit_exactly_once_and_balanced(shape):
    units, n1, n2 = shape
    m = ntp_map(units, n1, n2)
    seen = sorted(u for r in range(n1) for u in m.units_of(r))
    assert seen == list(range(units))
    loads = [m.load(r) for r in range(n1)]
    assert max(loads) - min(loads) <= 1
    assert max(loads) == max_units_per_rank(units, n1)


@settings(max_examples=400, deadline=None)
@given(shapes())
def test_core_ranks_keep_a_contiguous_prefix_of_their_chunk(shape):
    units, n1, n2 = shape
    m = ntp_map(units, n1, n2)
    assert len(m.sync_chunks) == n2
    for i, (a, b) in enumerate(m.sync_chunks):
        (core,) = m.assignment[i]  # exactly one range
        assert core[0] == a and core[1] <= b
    # sync chunks tile 0..units-1 contiguously and evenly
    assert m.sync_chunks[0][0] == 0 and m.sync_chunks[-1][1] == units
    sizes = [b - a for a, b in m.sync_chunks]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=300, deadline=None)
@given(shapes())
def test_transfers_return_every_lent_unit_to_its_chunk_owner(shape):
    units, n1, n2 = shape
    m = ntp_map(units, n1, n2)
    for t in m.transfers:
        a, b = m.sync_chunks[t.core]
        assert a <= t.start and t.stop <= b  # the units belong to the core's sync chunk
        assert t.extra >= n2
        assert set(range(t.start, t.stop)) <= set(m.units_of(t.extra))
    lent = sum(t.count for t in m.transfers)
    assert lent == sum(m.load(r) for r in range(n2, n1))


def test_uniform_map_is_the_plain_even_split():
    m = ntp_map(10, 4, 4)
    assert m.assignment == tuple((c,) for c in even_chunks(10, 4))
    assert m.transfers == ()


def test_worked_example_tp4_plus_tp2():
    # docs/references.md, the worked example: healthy TP4 + reduced TP2 -> TP groups [0,1] and [2,3,4,5];
    # DP groups [0,2], [1,3], [4], [5].
    assert sync_groups([[0, 1], [2, 3, 4, 5]]) == [[0, 2], [1, 3], [4], [5]]
    # Units: 8 heads. Sync chunks of the TP2 replica: [0,4) and [4,8). The TP4 replica's core ranks
    # keep 2 heads of their chunk each and lend the tail to the extras: 8/4 = 2 per rank.
    m = ntp_map(8, 4, 2)
    assert m.sync_chunks == ((0, 4), (4, 8))
    assert [m.units_of(r) for r in range(4)] == [[0, 1], [4, 5], [2, 3], [6, 7]]


def test_sync_groups_with_three_degrees():
    # degrees 3, 2, 4 -> sync degree 2
    assert sync_groups([[0, 1, 2], [3, 4], [5, 6, 7, 8]]) == [[0, 3, 5], [1, 4, 6], [2], [7], [8]]


def test_bad_arguments_raise():
    import pytest

    for args in [(10, 4, 0), (10, 3, 4), (3, 4, 2)]:
        with pytest.raises(ValueError):
            ntp_map(*args)
    with pytest.raises(ValueError):
        sync_groups([[0], []])
