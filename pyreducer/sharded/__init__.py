"""Sharded reduction: `model.overlap_optimizer(optimizer, shard=True)`.

Note [Sharded step]
The overlapped optimizer (Note [Overlapped step] in pyreducer/overlap/optimizer.py) with the state
and the update of each element on one rank only (ZeRO-2's division of work, on pyreducer's buckets):
  - backward: each bucket, full, is reduce-scattered instead of all-reduced (Note [Sharded
    buckets] in csrc/reducer.h): rank r receives the sum of its 1/N of the bucket's buffer; each
    .grad is let go once copied into its bucket (Note [Sharded gradients]);
  - step() records the update; the next forward's first read of a parameter (or
    synchronize()) runs it for every bucket, first-read buckets first: the bucket's reduction
    waited for, its shard stepped by the optimizer's own class over this rank's pieces
    (pyreducer/sharded/pieces.py), segment by segment, and its buffer all-gathered in place
    (each rank contributes its updated 1/N), each segment sent once stepped, in the order the
    forward reads (Note [Gathers in read order] in pyreducer/sharded/gather_plan.py). The
    all-gathers run while the forward goes on; a parameter's first read waits for its own
    elements only, then it is written from the buffer; once a bucket's parameters are all
    written its buffer's memory is given back until the next backward (Note [Released bucket
    buffers]): through the forward a rank holds 1/N of the gradients (its shards);
  - max_grad_norm: the pieces' squared norms summed over ranks (one all-reduce of one number),
    then torch's clip arithmetic on each piece. Unused parameters (find_unused_parameters):
    a parameter unused on every rank keeps its own .grad, as with torch DDP (None: not stepped).
What differs from torch DDP, by design: between backward and step() no rank holds a whole
averaged gradient, so reading a parameter's .grad then raises (name, rank); after the update a
parameter's .grad is None (or zeros with zero_grad(set_to_none=False)): the update implies
zero_grad(). Two synced backwards without a step() or zero_grad() between them are refused
(the second would overwrite the first's shards); accumulate under no_sync(), as with DDP.
Exactness: the optimizers of checks.ELEMENTWISE update each element from that element alone, so
a piece's step is the whole step's restricted to it, bit for bit. On Gloo the reduce-scatters
sum every element in the order of Gloo's all-reduce (Note [Ring collectives on Gloo] in
csrc/ring.h), so each shard is torch DDP's averaged gradient bit for bit at any world size (up to
the rings' 64 ranks), and so is a clip's norm (Note [Clipping shards]). What it rests on: the
same buckets as torch DDP (a bucket's elements decide Gloo's chunks, and so its summation order).
On NCCL the reduce-scatter's order is NCCL's own (within float rounding of its all-reduce).

Note [Sharded optimizer state]
Shards cut through parameters where buckets do: bucket b's buffer is cut into N equal shards,
the chunks Gloo's ring all-reduce leaves on each rank (csrc/bucket.h: shard_numel; the buffer
padded after its elements to N of them, so a last rank's shard may be partly or all padding, more
so in small buckets); rank r's shard holds, for each parameter whose slot
overlaps it, a piece: the elements [start, stop) of that parameter in its memory order (the
slot's order; layout.py). The optimizer's state is kept per piece: each elementwise state
tensor (exp_avg, exp_avg_sq, momentum_buffer, square_avg, sum, ...) holds the piece's elements
only, and per-parameter scalars (step) are held by every piece of the parameter, all equal. A
parameter's state thus lives on the one to N ranks its slot overlaps, ~1/N of the whole state
per rank. state_dict() gathers each parameter's pieces whole, one parameter at a time, into
torch's format; load_state_dict() cuts a whole state (from any optimizer of the class) into
pieces; sharded_state_dict() saves this rank's pieces with their layout, loaded directly where
the buckets are the same, else gathered and cut again. A new bucket plan (the rebuild after the
first iteration) moves the state the same way, once.
"""
from pyreducer.sharded.optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
