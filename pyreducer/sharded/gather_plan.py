"""The order of a bucket's all-gather (Note [Gathers in read order]): a pure function of the
bucket's slots, its shards and the world size, the same on every rank.

Note [Gathers in read order]
After step(), the next forward's first read steps every bucket's shard and all-gathers the
bucket's parameters (Note [Sharded step] in pyreducer/sharded/__init__.py). Gathered whole, a
bucket holds back the forward: at torch's default caps one bucket holds most of the model, its
first-read parameters (the first layers') sit at the end of its buffer, in the last rank's shard,
and the first read waited for every chunk to go round the ring (2 hosts: one chunk's time; 4
hosts: three). So each bucket's all-gather is cut and ordered by when the forward reads:
  - segments: the buffer's slots grouped from its end (the first layers') into runs of about
    SEGMENT_BYTES, cut at parameter boundaries, in the order the forward first reads them (the
    smallest parameter index in them: the order the module registers its parameters; the same
    on every rank, as a timed order would not be). A rank steps its shard segment by segment
    and marks each segment ready once stepped, so the gather starts while the rest is stepped;
    it steps them in the order its link sends them (GatherPlan.step_order; 2 ranks: read order);
  - pieces: each segment cut at the shards' boundaries and into messages of at most PIECE_BYTES
    (at 3+ ranks fewer where a shard is small, so that forwarded messages pipeline through the
    ring; at 2 ranks nothing is forwarded, and a message of 64 KiB costs more than one of 256:
    4 MiB gathered in 20.8 against 19.6 ms), numbered in read order (by the smallest parameter
    index they touch): a piece's number is its tag;
  - links: rank r sends to rank r - 1 (the rings' direction, csrc/ring.h). A simulation of the
    links (whole messages at the link's rate) fixes each link's order: a free link sends, of the
    pieces its receiver lacks and its sender holds, the one read first, so no link idles while
    it could carry something ("read order"). Every rank simulates the same and takes its two
    links' orders from it, so every rank posts the same messages under the same tags, whatever
    the timing. At 3+ ranks the read order keeps the busiest link a few percent longer than the
    ring's own order (link r passing chunks r, r + 1, ...: N - 1 chunks, the least), as the last
    pieces still pipeline through up to N - 2 hops. Both orders are simulated with a forward
    that reads the parameters in order and computes as long as the gather takes, and the one
    with which it ends first is taken: the read order where the first reads are a part of the
    bucket (at 2 ranks the two orders are one), the ring's where one parameter fills it;
  - per-parameter readiness: a read waits only for the pieces holding the parameter's elements
    (RingJob::wait_range), writes that parameter from the buffer and goes on while the rest of
    the bucket is on the wire; the bucket's last parameter waits for the whole gather, then the
    buffer is given back (Note [Released bucket buffers] in csrc/reducer.h).
The gather has no arithmetic: every element arrives as its owner stepped it, in any order, so the
results are the whole gather's, bit for bit. Nothing waits in a cycle (csrc/ring_gather.cpp: a
receiver thread takes the receives in the order the upstream link sends them, the worker posts
the sends in order, each once its piece is held): a send waits only for its own piece to be
stepped (the Python thread steps every segment before any read waits) or for a receive that the
simulation placed earlier in time, and a receive for a send placed earlier still. Padding (the
elements after the last slot) is not sent: nothing reads it.
Buckets of less than MIN_BUCKET_BYTES are stepped, then gathered whole, as before (one ring
all-gather; the first read waits for all of it): with 4 MB buckets the pieces' and the
parameters' own waits cost about what they save (step time / torch DDP's, same run, read order
against whole: transformer 0.945 / 0.956 and 0.927 / 0.895 at 2 and 4 hosts, mlp_large 0.902 /
0.880 and 0.925 / 0.919; record benchmarks/results/sharded_gather_20261129.md), and where
buckets are that small the forward waits for one bucket at a time anyway. So do the NCCL path
and Gloo beyond the rings' 64 ranks (comm.WholeGather).
"""
from __future__ import annotations

import dataclasses
import heapq

SEGMENT_BYTES = 1 << 20    # a segment is stepped, then marked ready, at once
PIECE_BYTES = 256 << 10    # a message at most (csrc/ring.cpp: kSegmentBytes, the rings' segment)
MIN_PIECE_BYTES = 64 << 10  # ... and at least, where the shard allows (a message's own cost)
PIECES_PER_SHARD = 16      # what a shard is cut into, between those bounds
MIN_BUCKET_BYTES = 8 << 20  # a smaller bucket is gathered whole: see the Note


@dataclasses.dataclass(frozen=True)
class Segment:
    """Contiguous slots of a bucket: elements [begin, end) of its buffer; `params`: their
    parameter indices, in slot order."""
    begin: int
    end: int
    params: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """One bucket's all-gather, in the order the forward reads.

    segments: in read order (step_order: a rank's); begins, ends: piece p is elements
    [begins[p], ends[p]) of the buffer, inside one rank's shard, and p is its message's tag;
    sends[r]: the pieces rank r sends to rank r - 1, in order; order: "read" or "ring" (whose
    sends these are), or "whole" (one segment, no pieces); link_numel: the simulated time of
    the busiest link, in elements;
    shard_numel: each rank's shard (rank r's: elements [r * shard_numel, (r + 1) * ...))."""
    segments: tuple[Segment, ...]
    begins: tuple[int, ...]
    ends: tuple[int, ...]
    sends: tuple[tuple[int, ...], ...]
    order: str
    link_numel: int
    shard_numel: int

    def receives(self, rank: int) -> tuple[int, ...]:
        """The pieces rank `rank` receives from rank + 1, in the order they come."""
        return self.sends[(rank + 1) % len(self.sends)]

    def step_order(self, rank: int) -> list[Segment]:
        """The segments in the order rank `rank` steps them: as its link sends their pieces of
        its own (a link sends in its own order; at 3+ ranks that may start with a segment read
        later), then the segments it owns nothing of, in read order."""
        sends = [p for p in (self.sends[rank] if self.sends else ())
                 if self.begins[p] // self.shard_numel == rank]
        first = {}
        for position, p in enumerate(sends):
            for index, segment in enumerate(self.segments):
                if segment.begin <= self.begins[p] < segment.end:
                    first.setdefault(index, position)
        return sorted(self.segments, key=lambda segment: (
            first.get(self.segments.index(segment), len(sends)),
            self.segments.index(segment)))


def segments_of(params: list[int], numels: list[int], offsets: list[int], element_size: int,
                segment_bytes: int = SEGMENT_BYTES) -> list[Segment]:
    """The bucket's segments (`params`: its parameter indices in slot order; `offsets`: their
    slots' first elements), grouped from the buffer's end, in read order."""
    segments, run = [], []
    for position in reversed(range(len(params))):
        run.append(position)
        run_bytes = (offsets[run[0]] + numels[params[run[0]]] - offsets[run[-1]]) * element_size
        if run_bytes >= segment_bytes or position == 0:
            first, last = run[-1], run[0]
            if run_bytes < segment_bytes and segments:  # a short rest (the last-read slots):
                last = params.index(segments.pop().params[-1])  # one with the segment before
            segments.append(Segment(offsets[first], offsets[last] + numels[params[last]],
                                    tuple(params[first:last + 1])))
            run = []
    return sorted(segments, key=lambda s: (min(s.params), s.begin))


def pieces_of(segments: list[Segment], params: list[int], numels: list[int],
              offsets: list[int], shard_numel: int, piece_numel: int) -> list[tuple[int, int]]:
    """Each segment cut at the shards' boundaries and into at most piece_numel elements, the
    pieces ordered by the smallest parameter index they touch (then by position)."""
    slots = sorted((offsets[k], offsets[k] + numels[i], i) for k, i in enumerate(params))
    keyed = []
    for segment in segments:
        begin = segment.begin
        while begin < segment.end:
            chunk_end = (begin // shard_numel + 1) * shard_numel
            end = min(segment.end, chunk_end, begin + piece_numel)
            first = min(i for a, b, i in slots if a < end and b > begin)
            keyed.append((first, begin, end))
            begin = end
    keyed.sort()
    return [(begin, end) for _, begin, end in keyed]


def simulate(begins, ends, owners, world_size: int, order: str):
    """Each link's sends (rank r to rank r - 1) and the busiest link's time, in elements.

    order "read": a free link sends, of the pieces its receiver lacks and its sender holds, the
    first in piece order (else it waits for the next arrival at its sender); "ring": link r
    sends rank r's pieces, then rank r + 1's, ..., each once it holds them."""
    count = len(begins)
    never = float("inf")
    held = [[never] * count for _ in range(world_size)]  # when a rank holds each piece
    for p in range(count):
        held[owners[p]][p] = 0
    if order == "ring":
        wanted = [[p for k in range(world_size - 1) for p in range(count)
                   if owners[p] == (r + k) % world_size] for r in range(world_size)]
    else:
        wanted = [[p for p in range(count) if owners[p] != (r - 1) % world_size]
                  for r in range(world_size)]
    sent = [[False] * count for _ in range(world_size)]
    sends = [[] for _ in range(world_size)]
    busy_until = [0] * world_size
    events = [(0, r) for r in range(world_size)]  # (time, link): the link may send then
    finished = 0
    while events:
        now, r = heapq.heappop(events)
        if now < busy_until[r] or len(sends[r]) == len(wanted[r]):
            continue
        pick = None
        for p in wanted[r]:
            if sent[r][p]:
                continue
            if held[r][p] <= now:
                pick = p
                break
            if order == "ring":
                break  # the ring's order is strict
        if pick is None:
            continue  # woken again when a piece arrives here
        to = (r - 1) % world_size
        sent[r][pick] = True
        sends[r].append(pick)
        busy_until[r] = done = now + ends[pick] - begins[pick]
        held[to][pick] = min(held[to][pick], done)
        finished = max(finished, done)
        heapq.heappush(events, (done, r))
        heapq.heappush(events, (done, to))
    for r in range(world_size):
        if len(sends[r]) != len(wanted[r]):
            raise AssertionError(f"gather plan: link {r} sent {len(sends[r])} of "
                                 f"{len(wanted[r])} pieces (a schedule that cannot finish)")
    return [tuple(s) for s in sends], finished, held


def forward_end(slots, begins, ends, owners, held, finished: int) -> float:
    """When a forward would end that reads the parameters in order (`slots`: (first element,
    end) of each, in read order), each once every rank holds its elements, and computes as
    long as the gather takes (spread over the elements)."""
    total = sum(end - begin for begin, end in slots)
    if not total:
        return 0.0
    by_begin = sorted(range(len(begins)), key=lambda p: begins[p])
    per_element = finished / total
    end_time, after = 0.0, total
    for begin, end in slots:
        ready = max((held[r][p] for p in by_begin if begins[p] < end and ends[p] > begin
                     for r in range(len(held)) if r != owners[p]), default=0)
        end_time = max(end_time, ready + per_element * after)
        after -= end - begin
    return end_time


def plan_bucket(params: list[int], numels: list[int], offsets: list[int], shard_numel: int,
                world_size: int, element_size: int, links: bool = True,
                min_bytes: int = MIN_BUCKET_BYTES) -> GatherPlan:
    """The all-gather plan of one bucket (Layout's buckets[b], its numels, slot_offsets[b] and
    shard_numel[b]): see Note [Gathers in read order]. Order "whole" (one segment, no pieces:
    the bucket stepped, then gathered whole, comm.WholeGather) without links (links=False: no
    rings), at one rank, and for a bucket of less than `min_bytes`."""
    used = sum(numels[i] for i in params)
    if not links or world_size == 1 or used * element_size < min_bytes:
        whole = Segment(0, used, tuple(params))
        return GatherPlan((whole,), (), (), ((),) * world_size, "whole", 0, shard_numel)
    segments = segments_of(params, numels, offsets, element_size)
    per_piece = max(1, min(PIECE_BYTES // element_size,
                           max(MIN_PIECE_BYTES // element_size, shard_numel // PIECES_PER_SHARD)))
    if world_size == 2:  # nothing is forwarded: the largest messages (each costs a little)
        per_piece = max(1, PIECE_BYTES // element_size)
    pieces = pieces_of(segments, params, numels, offsets, shard_numel, per_piece)
    begins = tuple(b for b, _ in pieces)
    ends = tuple(e for _, e in pieces)
    owners = [b // shard_numel for b in begins]
    slots = [(offsets[k], offsets[k] + numels[i])
             for k, i in sorted(enumerate(params), key=lambda item: item[1])]
    best = None
    for order in ("read", "ring"):
        sends, finished, held = simulate(begins, ends, owners, world_size, order)
        end = forward_end(slots, begins, ends, owners, held, finished)
        if best is None or end < best[0]:  # (equal: the read order)
            best = (end, GatherPlan(tuple(segments), begins, ends, tuple(sends), order,
                                    finished, shard_numel))
    return best[1]
