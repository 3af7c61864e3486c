// Ring reduce-scatter and all-gather of bucket buffers over point-to-point messages, for Gloo.
//
// Note [Ring collectives on Gloo]
// Gloo's reduce-scatter (ProcessGroupGloo::_reduce_scatter_base) costs as much as its all-reduce
// (measured on the emulated 1 Gbit/s link, 25 MB: 2 ranks 230-253 ms against 222 ms for the
// all-reduce and 115 ms for this ring; 4 ranks 353 ms against 330 ms and 180 ms), which makes a
// sharded step move twice the bytes of torch DDP's. So sharded buckets on Gloo travel in rings
// of sends and receives instead, which sum every element in the order of Gloo's own ring
// all-reduce (gloo/allreduce.cc, ring()), torch DDP's on Gloo:
// - Gloo's all-reduce leaves rank c with the sum of chunk c, a fixed cut of the buffer into
//   world-size chunks (shard_numel in bucket.h); a sharded bucket's shards are those chunks
//   (padded after the last one, so all have one size).
// - Gloo passes chunk c down the ring: rank c - 1 sends its values to rank c - 2, which adds its
//   own and sends on, ..., until rank c adds its own last: x[c] + (x[c+1] + (... + (x[c-2] +
//   x[c-1]))). This ring does the same: a reduce-scatter is N - 1 steps, in step k rank r sending
//   its running sum of chunk (r + 1 + k) mod N to rank r - 1 and adding its own values of chunk
//   (r + 2 + k) mod N to what rank r + 1 sends; after the last step rank r holds chunk r.
// So a sharded step's reduced gradients equal torch DDP's all-reduced ones bit for bit at any
// world size (tests/multirank/test_sharded.py checks both against Gloo's all-reduce, with
// buckets of many segments), each rank having sent (N - 1)/N of the buffer, the least any
// reduce-scatter sends, and half what an all-reduce sends. An all-gather is the same ring
// without the sums, in place. One worker thread runs the jobs in the order they were enqueued,
// the same on every rank (buckets in launch order, then the all-gathers in the sharded step's
// order), on a Gloo backend of its own: only its thread sends and receives there (and a planned
// all-gather's receiver thread, while that job runs), with a tag per job and step. The buffer is
// not written: the running sums live in chunk-sized buffers (with 2 ranks, in the shard itself).
// A sharded step's all-gathers follow a plan instead: piece by piece, in the order the next
// forward reads, each piece waited for on its own (ring_gather.cpp; see
// Note [Gathers in read order] in pyreducer/sharded/gather_plan.py).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm.h"

namespace pyreducer {

// A planned all-gather (see Note [Gathers in read order] in pyreducer/sharded/gather_plan.py):
// the buffer's elements cut into pieces, each inside one rank's chunk, and the order of this
// rank's messages. Piece p is elements [begins[p], ends[p]) and travels under tag p (of the job).
struct GatherPlan {
  std::vector<int64_t> begins;
  std::vector<int64_t> ends;
  std::vector<int64_t> sends;     // the pieces this rank sends to rank - 1, in this order
  std::vector<int64_t> receives;  // the pieces rank + 1 sends to this rank, in its order
};

// One ring collective: done once its last step finished (or failed).
class RingJob {
 public:
  // Blocks until the job is done; rethrows its failure as CollectiveError naming `what_`.
  // Bounded: each of its steps waits at most the backend's timeout. Any thread.
  void wait();
  bool done() const;
  // When the job finished (Timeline::now_ns on the worker), 0 before. Any thread.
  int64_t done_ns() const;

  // Planned all-gathers (RingCollectives::all_gather with a plan), any thread. Blocks until
  // every element of [begin, end) outside this rank's chunk has arrived (the whole job, for
  // an unplanned one); rethrows the job's failure as wait() does.
  void wait_range(int64_t begin, int64_t end);
  // This rank's elements in [begin, end) hold their final values: the pieces wholly inside may
  // be sent. Until a piece of its own is marked, the job waits (at most the timeout) to send it.
  void mark_ready(int64_t begin, int64_t end);
  // Nothing more will be marked ready (the caller failed): the job fails without sending the
  // rest, naming `why` (its peers' receives time out).
  void cancel(const std::string& why);

 private:
  friend class RingCollectives;
  // A planned all-gather's pieces: where each lies, whether it is here (received, or this
  // rank's own) and may be sent (received, or own and marked ready). Guarded by mutex_.
  struct Pieces {
    std::vector<int64_t> begins, ends;
    std::vector<int64_t> by_begin;  // the pieces sorted by where they begin
    std::vector<uint8_t> own, here, sendable;
    std::string cancelled;          // why, once cancel() was called
    std::exception_ptr receive_error;
  };
  // The pieces overlapping [begin, end) all here. Caller holds mutex_.
  bool arrived(int64_t begin, int64_t end) const;
  // The worker's side: blocks until piece p may be sent (at most `timeout`), or throws.
  void wait_sendable(int64_t p, std::chrono::milliseconds timeout);
  void set_arrived(int64_t p);
  void set_receive_error(std::exception_ptr error);

  std::function<void()> body_;
  std::string what_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  int64_t done_ns_ = 0;
  std::exception_ptr error_;
  std::unique_ptr<Pieces> pieces_;  // planned all-gathers only
};

class RingCollectives {
 public:
  static constexpr int64_t kMaxWorldSize = 64;  // the message tags' range
  static constexpr int kTagsPerJob = (1 << 14) * kMaxWorldSize;  // a job's tags: its steps'
  // segments, or a planned all-gather's pieces


  // `backend`: a Gloo backend over the group's ranks that nothing else uses (see Note [Ring
  // collectives on Gloo]); `timeout`: the most any send or receive may take. Python thread.
  RingCollectives(BackendPtr backend, std::chrono::milliseconds timeout);
  // Fails the jobs not run yet and joins the worker. Any thread but the worker.
  ~RingCollectives();
  RingCollectives(const RingCollectives&) = delete;
  RingCollectives& operator=(const RingCollectives&) = delete;

  // Enqueues the SUM reduce-scatter of `flat` (n x world size elements) into `shard` (n): rank
  // r's shard receives elements [r n, (r + 1) n) of the sum, summed in Gloo's all-reduce order
  // where n is shard_numel (bucket.h) of the elements before the padding (its completion time:
  // RingJob::done_ns). Every rank enqueues the same jobs in the same order. Any thread.
  std::shared_ptr<RingJob> reduce_scatter(at::Tensor flat, at::Tensor shard, std::string what);

  // Enqueues the all-gather of every rank's chunk of `flat` (rank r's: elements [r n, (r+1) n))
  // into every rank's `flat`, in place. Ordering as reduce_scatter. Any thread.
  std::shared_ptr<RingJob> all_gather(at::Tensor flat, std::string what);
  // The same, planned: the pieces of `plan` travel in its order (every rank's plan from the
  // same pieces), each of this rank's own sent once marked ready (RingJob::mark_ready); the
  // elements outside the pieces are not sent. Any thread. See ring_gather.cpp.
  std::shared_ptr<RingJob> all_gather(at::Tensor flat, GatherPlan plan, std::string what);

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_; }

 private:
  std::shared_ptr<RingJob> enqueue(std::function<void()> body, std::string what);
  std::shared_ptr<RingJob> enqueue(std::shared_ptr<RingJob> job, std::function<void()> body,
                                   std::string what);
  void run();
  // One step: sends `out` to rank - 1 and receives `in` from rank + 1, both waited for.
  void exchange(const at::Tensor& out, const at::Tensor& in, int tag);
  void run_reduce_scatter(const at::Tensor& flat, const at::Tensor& shard);
  void run_all_gather(const at::Tensor& flat);
  void run_planned_all_gather(const at::Tensor& flat, const GatherPlan& plan, RingJob& job);
  int next_job_tag();  // the worker's: the first tag of the next job's range

  BackendPtr backend_;
  std::chrono::milliseconds timeout_;
  int64_t rank_ = 0;
  int64_t world_ = 1;
  int next_tag_ = 0;  // the worker's only
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<RingJob>> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace pyreducer
