// Bucket storage: flat buffers and the per-parameter slot views into them.
//
// Note [Streams of a bucket]
// On a GPU, a gradient is copied into its slot on the stream its AccumulateGrad node ran on
// (autograd sets it current for the hook). The bucket is launched from whichever hook completes
// the next bucket in order, so possibly from another thread and stream (multi-device modules,
// backward on side streams), and the batched copy reads all of a bucket's gradients on the last
// one's stream. ProcessGroupNCCL orders a collective only after the launching thread's current
// stream. So each bucket notes the distinct streams its gradients were copied (or produced) on,
// and before the batched copy or the launch the current stream waits for the others: an event
// recorded on each such stream at that moment covers everything enqueued there before, the
// copies included (they happened before, under the Reducer's lock). One stream, the usual case,
// costs nothing. torch DDP leaves this as a TODO. Compiled, not run: no GPU has run this yet.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Stream.h>

#include "comm.h"

namespace pyreducer {

class RingJob;  // ring.h

struct Bucket {
  // The bucket: one buffer, all-reduced as a whole. A sparse bucket (one parameter that produces
  // sparse gradients) has no buffer of its own: flat is that parameter's .grad while an
  // iteration reduces it (divided in place, reduced, written back), as in torch DDP.
  at::Tensor flat;
  bool sparse = false;
  std::vector<int64_t> param_indices;  // slot order
  std::vector<at::Tensor> views;       // views[k]: slot of param_indices[k], shaped like it
                                       // (none in a sparse bucket)
  std::vector<int64_t> offsets;        // offsets[k]: first element of views[k] in flat
  int64_t size_bytes = 0;
  size_t pending = 0;                  // slots not yet filled this iteration
  bool skipped = false;                // not reduced this iteration (skip_all_reduce_unused_params)
  std::vector<WorkPtr> works;          // in-flight all-reduces (no hook), one per chunk
                                       // launched (see Note [Launch order]); empty: none
  size_t chunks_launched = 0;          // this iteration's
  c10::intrusive_ptr<c10::ivalue::Future> future;  // in-flight hook result (with a hook)
  // The completion stamps of works (one each) or of future (one), null where nothing is
  // recorded, and the timeline record they go into once waited for (record_iteration -1: none).
  // See Note [Completion stamps] in timeline.h.
  std::vector<StampPtr> done_stamps;
  size_t record_slot = 0;
  int64_t record_iteration = -1;
  // Sharded buckets (see Note [Sharded buckets] in reducer.h): this rank's 1/world_size of the
  // reduce-scattered sum, elements [rank * n, (rank + 1) * n) of flat; undefined otherwise.
  at::Tensor shard;
  bool released = false;  // its buffer's memory given back (see Note [Released bucket buffers])
  std::shared_ptr<RingJob> ring_job;  // its reduce-scatter in a ring (see Note [Ring collectives
                                      // on Gloo] in ring.h); null otherwise
  std::vector<c10::Stream> copy_streams;  // see Note [Streams of a bucket]
  // Non-CPU: the streams made to wait for its reductions (Reducer::wait_bucket), on which the
  // buffer must be recorded before it is freed (Reducer::install_plan).
  std::vector<c10::Stream> wait_streams;
  // check_finite (see Note [Finite check]): 0-dim bool tensors, undefined when not computed.
  at::Tensor local_nonfinite;    // this rank's gradients held a NaN/Inf (or their sum overflowed)
  at::Tensor reduced_nonfinite;  // the reduced bucket's sum is not finite
};

struct SlotLocation {
  size_t bucket = 0;
  size_t slot = 0;
};

struct BucketSet {
  std::vector<Bucket> buckets;           // launch order
  std::vector<SlotLocation> locations;   // per parameter
};

// Allocates one zeroed flat buffer per entry of `plan` (launch order; each entry lists parameter
// indices in slot order) and a view per slot, laid out like its parameter (dense parameters keep
// their strides, so gradients keep the parameter's memory format). Parameters flagged in
// `sparse` (per parameter; empty: none) form sparse buckets, one parameter each, without buffer.
// Throws std::invalid_argument naming the parameter if the plan is not a partition of all
// parameters, a bucket mixes dtypes or devices, or a sparse parameter shares a bucket.
// `shards` > 0 (sharded, one shard per rank): each flat buffer is zero-padded to `shards` x
// shard_numel(...) elements after its last slot (size_bytes stays the slots'), and gets a zeroed
// `shard` of shard_numel elements (with 1 rank, a copy of the whole). 0: not sharded.
BucketSet make_buckets(const std::vector<at::Tensor>& params,
                       const std::vector<std::string>& param_names,
                       const std::vector<std::vector<int64_t>>& plan,
                       const std::vector<uint8_t>& sparse, int64_t shards = 0);

// The elements of each of `shards` equal shards of a bucket of `numel` elements of
// `element_size` bytes: the chunk Gloo's ring all-reduce leaves on each rank (gloo/allreduce.cc,
// ring(): segments of at most 1 MiB, as many as a multiple of `shards` and at least twice it;
// rank r's chunk is segments [r s, (r + 1) s), s = segments per rank), so that a ring
// reduce-scatter into these shards sums every element as torch DDP's Gloo all-reduce does (Note
// [Ring collectives on Gloo] in ring.h). At least ceil(numel / shards); 1 shard: numel. The one
// definition (Python reads it as pyreducer._C.shard_numel).
int64_t shard_numel(int64_t numel, int64_t shards, int64_t element_size);

// See Note [Released bucket buffers] in reducer.h. release_buffer frees a dense bucket's buffer
// memory (flat and its views keep their shapes over an empty storage); acquire_buffer allocates
// it again from the same allocator, on the buffer's device, with the padding after its slots
// zeroed and the slots' contents undefined (every slot is written before the bucket is read).
// Both are no-ops where there is nothing to do.
void release_buffer(Bucket& bucket);
void acquire_buffer(Bucket& bucket);
// See Note [Lazy bucket allocation] in reducer.h: gives a dense bucket a new, released buffer
// (flat and its views remade, with their shapes, over a new storage of the same allocator,
// without memory), leaving the old one to whatever else holds it; acquire_buffer gives it memory.
void renew_buffer(Bucket& bucket);

// Drops a gradient copied into its bucket (see Note [Sharded gradients] in reducer.h); off the
// CPU, first records the current stream on it: the copy enqueued there may not have run yet
// (compiled, not run).
void let_go_of_gradient(at::Tensor& grad);

// "dtype/device" of a tensor: parameters with different keys never share a bucket. The one
// definition (Python reads it as pyreducer._C.group_key).
std::string group_key(const at::Tensor& tensor);

// Bytes of a tensor's elements: what its slot takes in a bucket. The one definition (Python
// reads it as pyreducer._C.size_bytes).
int64_t size_bytes(const at::Tensor& tensor);

}  // namespace pyreducer
