"""Packing TP groups into pipeline replicas: the best total first, then the fewest moves.

Input: the groups to pack, each with a *key* (higher is better; a replica is worth its lowest
key: the usable GPU count under `ntp`, the local batch its power grant allows under `ntp-pw`) and
its *reference* slot (replica id, stage) in the previous plan, if it had one. Output: replicas of
P groups (each group at a stage) and the groups left over.

What is optimal. Sort the keys v1 >= v2 >= ... >= vn and let m = floor(n / P). In any partition
into m replicas the i-th best replica minimum is at most v_{iP} (it needs P members at least that
large), and cutting the sorted list into consecutive blocks reaches v_{iP} for every i at once. So
the best vector of replica minima is unique, and a partition reaches it exactly when, for every key
level t, the number of replicas whose members all have key >= t is floor(N_t / P), where N_t
counts the groups with key >= t. Equivalently: walking the levels from the top, each level must
close exactly floor(|S| / P) replicas out of the set S of groups not yet placed with key >= t, and
carry the remaining |S| mod P (< P) groups down to lower levels. Every such walk is optimal; this
module chooses, level by level, the walk that keeps the most groups in their reference slot.

The choice at one level: closing a reference replica keeps its members that are already in S (its
*stayers*); its other slots take *fillers*, preferring groups whose reference stage is the free
stage (they keep their layers). A reference replica with members still below the level may instead
be *carried* down whole, if the carry allowance (|S| mod P) holds its members, so that it closes
later with all of them. Which replicas close and which are carried is chosen by a small dynamic
programme over the carry allowance (< P): replicas are taken most stayers first, each either closed
(while closings are needed), carried (also one with no members below, to close at a lower level
when no closing is left here), or given up (its members become fillers). Unplaced members
of replicas that were closed elsewhere are fillers too. Groups carried past the last level are left
over; among equal choices those without a reference slot are left over first, so that groups
that were placed stay placed, then (ntp-pw) those whose rack holds another reduced group, so that
the reduced groups kept sit in racks with power to spare and an idle one frees its rack's power.

The level structure is exact (the optimum is never traded for fewer moves); the move count is
minimised greedily per level, which the tests compare with exhaustive search on small cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Item:
    idx: int  # the caller's index of the group (also the deterministic tie-break)
    key: int  # higher is better; a replica is worth its lowest key
    ref: tuple[int, int] | None  # (replica id, stage) in the reference layout
    # power to spare in the group's rack (ntp-pw): among otherwise equal groups, those with less are
    # carried down (and so left over) first, and their power goes to the rack-mates that stay
    slack: int = 0


@dataclass(slots=True)
class Block:
    rid: int | None  # reference replica id this replica keeps (None: a new replica)
    slots: list[int]  # item idx per stage, len P
    stayers: int  # members in their reference slot


def pack(items: Sequence[Item], P: int, stage_cost: Sequence[int] | None = None) -> tuple[list[Block], list[int]]:
    """Optimal packing of `items` into replicas of `P` with few groups out of their reference slot.

    `stage_cost[s]` (optional) is what loading stage s costs (its bytes): where a group must leave
    its slot, one from a cheaper stage is taken, since its slot is then refilled by a group that
    loads that stage. Returns the replicas (best level first) and the idx of the groups left over.
    Deterministic in the order of `items`."""
    if P < 1:
        raise ValueError("P must be positive")
    at: dict[int, list[Item]] = {}
    members: dict[int, dict[int, Item]] = {}
    for it in items:
        at.setdefault(it.key, []).append(it)
        if it.ref is not None:
            members.setdefault(it.ref[0], {})[it.ref[1]] = it
    levels = sorted(at, reverse=True)
    # The lowest level that closes a replica: members below it are left over whatever happens.
    seen = bottom = 0
    for key in levels:
        if (seen + len(at[key])) // P > seen // P:
            bottom = key
        seen += len(at[key])
    formed: set[int] = set()
    blocks: list[tuple[int | None, list[Item | None]]] = []
    carry: list[Item] = []
    seen = closed = 0
    for key in levels:
        level = at[key]
        S = carry + level
        seen += len(level)
        need = seen // P - closed
        closed += need
        allowance = len(S) - P * need
        if need == 0:
            carry = S
            continue
        in_s: dict[int, list[Item]] = {}
        for it in S:
            if it.ref is not None and it.ref[0] not in formed:
                in_s.setdefault(it.ref[0], []).append(it)
        # low: members further down that could still be placed in this replica's slot later
        cands = [
            (rid, its, sum(1 for m in members[rid].values() if bottom <= m.key < key)) for rid, its in in_s.items()
        ]
        cands.sort(key=lambda c: (c[2] - len(c[1]), -len(c[1]), c[0]))
        close, keep_whole = _choose([(len(c[1]), c[2]) for c in cands], need, allowance)

        used: set[int] = set()
        level_blocks: list[tuple[int | None, list[Item | None]]] = []
        for i in close:
            rid, its, _ = cands[i]
            formed.add(rid)
            slots: list[Item | None] = [None] * P
            for it in its:
                assert it.ref is not None
                slots[it.ref[1]] = it
                used.add(it.idx)
            level_blocks.append((rid, slots))
        for _ in range(need - len(close)):
            level_blocks.append((None, [None] * P))
        carried = [it for i in keep_whole for it in cands[i][1]]
        used.update(it.idx for it in carried)
        rest = [it for it in S if it.idx not in used]
        # Pad the carry up to the allowance: members of replicas that may still close lower first,
        # then groups that were not placed before (leaving them idle moves nothing), then the rest;
        # within each, groups whose reference stage is a free slot here are kept back as fillers.
        pad = allowance - len(carried)
        if pad:
            waiting = {rid for rid, _, low in cands if low and rid not in formed}
            free_stages = {st for _, slots in level_blocks for st, x in enumerate(slots) if x is None}
            ranked = sorted(
                (
                    (
                        0 if x.ref is not None and x.ref[0] in waiting else 1 if x.ref is None else 2,
                        x.ref is not None and x.ref[1] in free_stages,
                        -(stage_cost[x.ref[1]] if stage_cost is not None and x.ref is not None else 0),
                        x.slack,
                        x.idx,
                    ),
                    x,
                )
                for x in rest
            )
            chosen = [x for _, x in ranked[:pad]]
            picked = {it.idx for it in chosen}
            carried += chosen
            rest = [it for it in rest if it.idx not in picked]
        _fill(level_blocks, rest)
        blocks.extend(level_blocks)
        carry = carried
    # Ids last: each replica takes the reference id most of its members share, greedily by members
    # kept, the id it closed under winning ties; then stages are arranged around those members.
    edges: list[tuple[int, int, int]] = []
    for b, (closed_as, slots) in enumerate(blocks):
        count: dict[int, int] = {}
        for x in slots:
            assert x is not None
            if x.ref is not None:
                count[x.ref[0]] = count.get(x.ref[0], 0) + 1
        edges.extend((-(2 * n + (r == closed_as)), b, r) for r, n in count.items())
    edges.sort()
    rid_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, b, r in edges:
        if b not in rid_of and r not in taken:
            rid_of[b] = r
            taken.add(r)
    out: list[Block] = []
    for b, (_, slots) in enumerate(blocks):
        kept = rid_of.get(b)
        arranged = _arrange([x for x in slots if x is not None], kept, P)
        stay = sum(1 for s, x in enumerate(arranged) if kept is not None and x.ref == (kept, s))
        out.append(Block(kept, [x.idx for x in arranged], stay))
    return out, [x.idx for x in carry]


def _arrange(group: list[Item], rid: int | None, P: int) -> list[Item]:
    """Stages of one replica: its members of reference replica `rid` at their stages, then others
    at their own reference stage where it is free (they keep their layers), then in order."""
    slots: list[Item | None] = [None] * P
    rest: list[Item] = []
    for it in group:
        if rid is not None and it.ref is not None and it.ref[0] == rid:
            slots[it.ref[1]] = it
        else:
            rest.append(it)
    later: list[Item] = []
    for it in rest:
        if it.ref is not None and slots[it.ref[1]] is None:
            slots[it.ref[1]] = it
        else:
            later.append(it)
    fill = iter(later)
    return [cur if cur is not None else next(fill) for cur in slots]


def _choose(cands: list[tuple[int, int]], need: int, allowance: int) -> tuple[list[int], list[int]]:
    """Which candidate replicas to close now and which to carry down whole.

    A candidate has `a` members at hand and `low` members further down that could still be kept.
    Closing it keeps `a` now and gives up `low`; carrying it uses `a` of the allowance and keeps
    `a + low` later; leaving it (its members at hand become fillers) may still keep `low` later.
    Relative to leaving every candidate, closing gains `a - low` and carrying gains `a`. Candidates
    come sorted by closing gain; for a given carried set the best closings are the first `need`
    others whose gain is not negative, so the programme only has to choose the carried set (its
    state: allowance used, candidates carried). Maximises the gain; on ties, carries less."""
    if not cands:
        return [], []

    def closes(i: int, carried_before: int) -> bool:
        a, low = cands[i]
        return (i - carried_before) < need and a >= low

    if allowance == 0:
        return [i for i in range(len(cands)) if closes(i, 0)], []
    states: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {(0, 0): (0, ())}
    for i, (a, low) in enumerate(cands):
        nxt: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        for (used, k), (value, path) in states.items():
            v = value + (a - low if closes(i, k) else 0)
            old = nxt.get((used, k))
            if old is None or v > old[0]:
                nxt[(used, k)] = (v, path)
            if used + a <= allowance:
                key = (used + a, k + 1)
                v = value + a
                old = nxt.get(key)
                if old is None or v > old[0]:
                    nxt[key] = (v, (*path, i))
        states = nxt
    _, (_, carried) = max(states.items(), key=lambda kv: (kv[1][0], -kv[0][0], -kv[0][1]))
    keep = set(carried)
    close: list[int] = []
    k = 0
    for i in range(len(cands)):
        if i in keep:
            k += 1
        elif closes(i, k):
            close.append(i)
    return close, list(carried)


def _fill(blocks: list[tuple[int | None, list[Item | None]]], fillers: list[Item]) -> None:
    """Put `fillers` into the empty slots: first where a filler's reference stage is free (it keeps
    its layers), then in order."""
    by_stage: dict[int, list[Item]] = {}
    for it in reversed(fillers):  # reversed: pop() takes them in order
        if it.ref is not None:
            by_stage.setdefault(it.ref[1], []).append(it)
    placed: set[int] = set()
    for _, slots in blocks:
        for s, cur in enumerate(slots):
            if cur is not None:
                continue
            queue = by_stage.get(s)
            while queue and queue[-1].idx in placed:
                queue.pop()
            if queue:
                it = queue.pop()
                slots[s] = it
                placed.add(it.idx)
    rest = iter(it for it in fillers if it.idx not in placed)
    for _, slots in blocks:
        for s, cur in enumerate(slots):
            if cur is None:
                slots[s] = next(rest)
