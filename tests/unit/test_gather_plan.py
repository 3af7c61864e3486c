"""The sharded step's all-gather plans (pyreducer/sharded/gather_plan.py, Note [Gathers in read
order]), table-driven and against an executor of the plans' orders: segments in read order,
pieces that cover each bucket's elements once inside one shard, links that deliver every piece
once, in read order where that is chosen, and that finish whatever the links' speeds (no two
ranks ever wait for each other)."""
import heapq
import random

import pytest

from pyreducer._ext import _C
from pyreducer.sharded import gather_plan
from pyreducer.sharded.gather_plan import Segment

MIB = 2**20 // 4  # float32 elements in 1 MiB


def _offsets(params, numels):
    offsets, offset = [], 0
    for i in params:
        offsets.append(offset)
        offset += numels[i]
    return offsets, offset


def _plan(params, numels, world_size):
    """A planned gather, whatever the bucket's size (min_bytes=0)."""
    offsets, used = _offsets(params, numels)
    return gather_plan.plan_bucket(params, numels, offsets, _C.shard_numel(used, world_size, 4),
                                   world_size, 4, min_bytes=0), used


def _owners(plan):
    """The rank whose shard holds each piece."""
    return [b // plan.shard_numel for b in plan.begins]


# A bucket holds the parameters in reverse (the backward's order): the forward reads the end first.
MLP = ([5, 4, 3, 2, 1, 0], [4, 4 * MIB, 4, 4 * MIB, 4, 4 * MIB])  # 3 layers of 4 MiB + biases
# positions (0, 64 KiB), tokens (1, 8 MiB: read first, at the end), blocks of 64 B to 2 MiB
TRANSFORMER = ([7, 6, 5, 4, 3, 2, 0, 1], [MIB // 16, 8 * MIB, 64, MIB, 2 * MIB, 64, 2 * MIB,
                                          MIB // 2])
ONE_PARAM = ([1, 0], [4 * MIB, 8])  # one 16 MiB parameter fills it

# (params in slot order, numels) -> segments as (begin, end, params), in read order
SEGMENTS = [
    (MLP, [(8 * MIB + 8, 12 * MIB + 12, (1, 0)), (4 * MIB + 4, 8 * MIB + 8, (3, 2)),
           (0, 4 * MIB + 4, (5, 4))]),
    # from the end: 1 (512 KiB) and 0 (256 KiB) are less than SEGMENT_BYTES, with 2 (1 MiB)
    # more: one segment, read first (parameter 0); then 3
    (([3, 2, 0, 1], [MIB // 4, MIB // 2, MIB, MIB]),
     [(MIB, 2 * MIB + 3 * MIB // 4, (2, 0, 1)), (0, MIB, (3,))]),
    # tokens (1, 8 MiB) alone; positions (0) with the parameters before it up to 1 MiB, and the
    # 512 KiB left at the start (read last) with them, not alone
    (([4, 3, 2, 0, 1], [MIB // 16, 8 * MIB, 64, MIB, MIB // 2]),
     [(0, MIB // 2 + MIB + 64 + MIB // 16, (4, 3, 2, 0)),
      (MIB // 2 + MIB + 64 + MIB // 16, 9 * MIB + MIB // 2 + 64 + MIB // 16, (1,))]),
    # a 4 MiB bucket of a weight and its bias: one segment
    (([1, 0], [4 * MIB, 4]), [(0, 4 * MIB + 4, (1, 0))]),
    (([0], [10]), [(0, 10, (0,))]),
]


@pytest.mark.parametrize("bucket,expected", SEGMENTS)
def test_segments_in_read_order(bucket, expected):
    params, numels = bucket
    offsets, _ = _offsets(params, numels)
    segments = gather_plan.segments_of(params, numels, offsets, 4)
    assert segments == [Segment(*s) for s in expected]


CASES = [(MLP, w) for w in (2, 3, 4, 8)] + [(TRANSFORMER, w) for w in (2, 3, 4, 8)] + \
    [(ONE_PARAM, w) for w in (2, 4)] + [(([0, 1, 2], [7, 1, 3]), w) for w in (2, 3, 5)]


@pytest.mark.parametrize("bucket,world_size", CASES)
def test_pieces_cover_the_bucket_once_inside_one_shard(bucket, world_size):
    params, numels = bucket
    plan, used = _plan(params, numels, world_size)
    shard = plan.shard_numel
    covered = sorted(zip(plan.begins, plan.ends))
    assert covered[0][0] == 0 and covered[-1][1] == used  # the padding is not sent
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    for begin, end in covered:
        assert begin // shard == (end - 1) // shard
        assert end - begin <= gather_plan.PIECE_BYTES // 4
    for segment in plan.segments:  # a piece lies in one segment
        inside = [(b, e) for b, e in covered if segment.begin <= b < segment.end]
        assert all(e <= segment.end for _, e in inside)


def _first_param(plan, params, numels, p):
    offsets, _ = _offsets(params, numels)
    return min(i for i, o in zip(params, offsets)
               if o < plan.ends[p] and o + numels[i] > plan.begins[p])


@pytest.mark.parametrize("bucket,world_size", CASES)
def test_every_rank_receives_every_piece_once(bucket, world_size):
    params, numels = bucket
    plan, used = _plan(params, numels, world_size)
    owners = _owners(plan)
    count = len(plan.begins)
    for rank in range(world_size):
        received = plan.receives(rank)
        assert sorted(received) == [p for p in range(count) if owners[p] != rank]
        assert received == plan.sends[(rank + 1) % world_size]
    # the pieces are numbered (their tags) in read order: by the first parameter they touch
    firsts = [_first_param(plan, params, numels, p) for p in range(count)]
    assert firsts == sorted(firsts)


@pytest.mark.parametrize("bucket", [MLP, TRANSFORMER])
def test_two_ranks_send_their_own_pieces_in_read_order(bucket):
    params, numels = bucket
    plan, used = _plan(params, numels, 2)
    shard = plan.shard_numel
    assert plan.order == "read"
    for rank in range(2):
        own = [p for p in range(len(plan.begins)) if plan.begins[p] // shard == rank]
        assert list(plan.sends[rank]) == own


def _execute(plan, owners, world_size, rng):
    """Runs the plan's orders as csrc/ring_gather.cpp does (a link sends its pieces in order,
    each once its sender holds it; a rank's own pieces are ready at random times), with random
    link rates; returns when each rank held each piece, or raises if the links wait forever."""
    count = len(plan.begins)
    rate = [rng.uniform(0.3, 3.0) for _ in range(world_size)]
    held = [[None] * count for _ in range(world_size)]
    for p in range(count):
        held[owners[p]][p] = rng.uniform(0, 5.0)  # stepped, then marked ready
    position = [0] * world_size
    events = [(0.0, r) for r in range(world_size)]
    while events:
        now, r = heapq.heappop(events)
        if position[r] == len(plan.sends[r]):
            continue
        p = plan.sends[r][position[r]]
        if held[r][p] is None:
            continue  # woken when it arrives
        start = max(now, held[r][p])
        done = start + (plan.ends[p] - plan.begins[p]) / 1e5 / rate[r]
        to = (r - 1) % world_size
        assert held[to][p] is None, f"piece {p} sent twice to rank {to}"
        held[to][p] = done
        position[r] += 1
        heapq.heappush(events, (done, r))
        heapq.heappush(events, (done, to))
    stuck = [r for r in range(world_size) if position[r] != len(plan.sends[r])]
    assert not stuck, f"links {stuck} wait forever"
    return held


@pytest.mark.parametrize("bucket,world_size", CASES)
def test_the_orders_finish_whatever_the_links_speeds(bucket, world_size):
    params, numels = bucket
    plan, used = _plan(params, numels, world_size)
    owners = _owners(plan)
    rng = random.Random(world_size)
    for _ in range(20):
        held = _execute(plan, owners, world_size, rng)
        assert all(t is not None for row in held for t in row)


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_read_order_where_the_first_reads_are_a_part_of_the_bucket(world_size):
    """In the transformer-like bucket the first-read parameters (positions and tokens, 60% of
    it) reach every rank before the ring's order would bring them; a bucket that one
    parameter fills keeps the ring's order (reading it needs all of it either way)."""
    params, numels = TRANSFORMER
    plan, used = _plan(params, numels, world_size)
    assert plan.order == "read"
    offsets, _ = _offsets(params, numels)
    first = [(o, o + numels[i]) for i, o in zip(params, offsets) if i in (0, 1)]
    owners = _owners(plan)
    ready = {}
    for order in ("read", "ring"):
        _, _, held = gather_plan.simulate(plan.begins, plan.ends, owners, world_size, order)
        ready[order] = max(held[r][p] for p in range(len(plan.begins))
                           for begin, end in first if plan.begins[p] < end and
                           plan.ends[p] > begin for r in range(world_size) if r != owners[p])
    # (3 ranks: the first reads are most of the last two shards: 0.92; 4: 0.81; 8: 0.71)
    assert ready["read"] < {3: 0.95, 4: 0.85, 8: 0.75}[world_size] * ready["ring"], ready
    assert _plan(*ONE_PARAM, world_size)[0].order == "ring"


@pytest.mark.parametrize("bucket,world_size", CASES)
def test_a_rank_steps_first_what_its_link_sends_first(bucket, world_size):
    """step_order: the segments in the order of the rank's own pieces in its sends, each once
    (with 2 ranks: read order, as its sends are its own pieces in read order)."""
    params, numels = bucket
    plan, used = _plan(params, numels, world_size)
    shard = plan.shard_numel
    for rank in range(world_size):
        order = plan.step_order(rank)
        assert sorted(order, key=plan.segments.index) == list(plan.segments)
        own = [p for p in plan.sends[rank] if plan.begins[p] // shard == rank]
        firsts = []
        for p in own:
            segment = next(s for s in plan.segments if s.begin <= plan.begins[p] < s.end)
            if segment not in firsts:
                firsts.append(segment)
        assert order[:len(firsts)] == firsts
        if world_size == 2:
            assert order[:len(firsts)] == [s for s in plan.segments if s in firsts]


@pytest.mark.parametrize("bucket,world_size,links,expected", [
    (TRANSFORMER, 1, True, "whole"),     # one rank
    (TRANSFORMER, 256, False, "whole"),  # no rings (NCCL; Gloo beyond 64 ranks)
    (([1, 0], [4 * MIB, 4]), 2, True, "whole"),  # 4 MiB: less than MIN_BUCKET_BYTES
    (([1, 0], [8 * MIB, 4]), 2, True, "read"),  # 8 MiB
])
def test_whole_gathers(bucket, world_size, links, expected):
    """The bucket stepped, then gathered whole (comm.WholeGather): one segment, no pieces, no
    links simulated (which would take long at many ranks); at MIN_BUCKET_BYTES and more, in
    read order."""
    params, numels = bucket
    offsets, used = _offsets(params, numels)
    plan = gather_plan.plan_bucket(params, numels, offsets, _C.shard_numel(used, world_size, 4),
                                   world_size, 4, links)
    assert plan.order == expected and len(plan.sends) == world_size
    if expected == "whole":
        assert not plan.begins and plan.segments == (Segment(0, used, tuple(params)),)
        assert plan.step_order(0) == list(plan.segments)
