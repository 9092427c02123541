"""service/leadership/balance.py `moves`: which of a manager's streams go where, so the fleet evens out."""

from __future__ import annotations

from ntp_manager.service.leadership.balance import Landing, moves


def test_a_manager_within_its_share_moves_nothing() -> None:
    assert moves(5, "a", {"a": 5, "b": 5, "c": 4}, 0.1, 100) == {}
    assert moves(11, "a", {"a": 11, "b": 10, "c": 9}, 0.1, 100) == {}  # share 10, +10 % tolerance


def test_one_over_its_share_sheds_down_to_it_toward_the_emptiest() -> None:
    # a new manager c joined: a and b hold everything
    assert moves(60, "a", {"a": 60, "b": 60, "c": 0}, 0.1, 100) == {"c": 20}
    assert moves(2, "b", {"a": 0, "b": 2}, 0.1, 100) == {"a": 1}
    assert moves(9, "a", {"a": 9, "b": 0, "c": 3}, 0.0, 100) == {"b": 4, "c": 1}  # share 4


def test_the_moves_of_a_pass_are_bounded() -> None:
    assert sum(moves(10_000, "a", {"a": 10_000, "b": 0}, 0.1, 500).values()) == 500


def test_a_move_never_leaves_the_target_holding_as_many_as_this_one() -> None:
    assert moves(1, "a", {"a": 1, "b": 0}, 0.0, 100) == {}  # 0 and 1: moving would only swap them
    assert moves(3, "a", {"a": 3, "b": 2}, 0.0, 100) == {}  # share 3


def test_alone_or_holding_nothing_it_moves_nothing() -> None:
    assert moves(100, "a", {"a": 100}, 0.1, 100) == {}
    assert moves(0, "a", {"a": 0, "b": 7}, 0.1, 100) == {}
    assert moves(4, "a", {"a": 4, "": 0}, 0.0, 100) == {}  # a manager that advertises no address


def test_a_closed_manager_counts_for_the_share_but_gets_nothing() -> None:
    assert moves(60, "a", {"a": 60, "b": 60, "c": 0}, 0.1, 100, {"c"}) == {}  # b holds as many: no move
    assert moves(90, "a", {"a": 90, "b": 30, "c": 0}, 0.0, 100, {"c"}) == {"b": 30}  # share 40; b until even


def test_moves_that_do_not_land_close_the_target_until_they_do_or_the_hold_ends() -> None:
    land = Landing(hold=2)
    assert land.closed({"a": 2600, "c": 1900}) == set()
    land.told("c", 1900, 300)
    assert land.closed({"a": 2300, "c": 1950}) == {"c"}  # grew by 50 of 300: not landed
    assert moves(2300, "a", {"a": 2300, "b": 2600, "c": 1950}, 0.1, 500, {"c"}) == {}
    assert land.closed({"a": 2300, "c": 1960}) == {"c"}
    assert land.closed({"a": 2300, "c": 1960}) == set()  # held 2 passes: tried again
    land.told("c", 1960, 100)
    assert land.closed({"c": 2010}) == set()  # half of them arrived: landed
    land.told("c", 2010, 10)
    assert land.closed({"a": 5}) == set()  # the target is gone


def test_moves_told_in_one_pass_add_up() -> None:
    land = Landing()
    land.told("c", 100, 40)
    land.told("c", 130, 40)  # a second call in the same pass: base stays at 100, told 80
    assert land.closed({"c": 130}) == {"c"}
    assert land.closed({"c": 140}) == set()
