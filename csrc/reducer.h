// The Reducer: flat gradient buckets, autograd hooks, and in-order asynchronous all-reduce.
//
// Note [Reducer iteration]
// One synced iteration goes through these states, on every rank in the same order:
//   1. prepare_for_backward(outputs) (end of the wrapper's forward, Python thread) arms the
//      reducer and threads the outputs through a sink node whose backward runs first in the
//      outer backward: it queues finalize_backward() on that (outermost) graph task, so reentrant
//      backward passes (activation checkpointing) cannot end the iteration early.
//   2. During backward, the post-hook on each parameter's AccumulateGrad node calls
//      mark_variable_ready(i): it copies grad * (1/world_size) into the parameter's slot and,
//      when a bucket's last slot is filled, launches every ready bucket that is next in index
//      order (all ranks launch buckets 0, 1, 2, ... in that order, so collectives match).
//   3. finalize_backward() runs when backward ends: it checks that every parameter produced a
//      gradient (else it raises, naming them), waits on every bucket's work, writes the averaged
//      gradients into param.grad (nothing to write for bucket views), and disarms.
// While disarmed (no_sync, or a forward without grad) the hooks do nothing: gradients accumulate
// locally and the next synced backward reduces the accumulated sum.
//
// Note [Unused parameters]
// With find_unused_parameters (and no static graph), prepare_for_backward walks the autograd
// graph from the outputs; parameters it cannot reach are marked ready when backward starts
// (their slot holds their current .grad, or zeros). Each rank also records which parameters got
// a defined gradient since the last synced step (no_sync micro-batches included); that map is
// all-reduced after the last bucket, and parameters unused on every rank keep their .grad as is.
// With static_graph, the first iteration only counts how often each hook fires; at its end all
// gradients are reduced at once in parameter order. Later iterations trust those counts: a
// parameter is ready when its hook has fired that many times (reentrant checkpointing fires
// some hooks several times), and parameters never seen are marked ready at backward start.
//
// Note [Sparse gradients]
// A parameter that produces sparse gradients (nn.Embedding/EmbeddingBag with sparse=True, as
// torch DDP detects them) has a bucket of its own, without buffer: when its hook fires, its
// .grad is divided by the world size in place (unless a communication hook averages), all-reduced
// as a sparse tensor, and the result copied back into that same .grad, as torch DDP does. Its
// gradient must be defined in every synced backward (torch raises too); gradient_as_bucket_view
// and batched_grad_copy leave it alone.
//
// Note [Sparse gradients beside Gloo's race]
// torch 2.8 onwards: ProcessGroupGloo's worker threads (2 by default) each assign the group's
// status string lastCompletedWorkName, unlocked, after every collective; a sparse all-reduce's
// name ("_ALLREDUCE_SPARSE", 17 characters) is longer than libstdc++'s inline buffer, so two
// threads finishing at once can free one heap buffer twice (heap corruption, crashes; a plain
// torch reproducer: tests/upstream/gloo_sparse_race.py). pyreducer therefore all-reduces sparse
// buckets on a Gloo backend of the same ranks with ONE worker thread
// (pyreducer/wrapper/gloo_race.py): its string is only ever written by that thread, and the group's
// own threads only ever write short names. Dense buckets, and overlap, are as before; the sums are
// the same.
//
// Note [Sharded buckets]
// With sharding on (a sharded overlapped optimizer, pyreducer/sharded/), each bucket's buffer is
// zero-padded to world size x n elements (n = shard_numel in bucket.h: the chunk Gloo's ring
// all-reduce leaves on each rank) and reduce-scattered instead of all-reduced: rank r receives
// elements [r * n, (r + 1) * n) of the sum in the bucket's `shard`, and param.grad is not written
// back (no rank holds the whole average; the optimizer steps the shard and all-gathers the
// parameters). The pre-scaling by 1/world_size at copy-in, the launch order and the overlap are
// as for an all-reduce; one collective per bucket (no chunks, no communication hook, no sparse
// gradients). On Gloo the reduce-scatters run in rings that sum as Gloo's all-reduce does (Note
// [Ring collectives on Gloo] in ring.h): each shard is torch DDP's all-reduced gradients' bit
// for bit, at any world size. Without a ring (more ranks than it takes) they go to a one-thread
// Gloo backend (its op name is long: Note [Sparse gradients beside Gloo's race]), whose
// reduce-scatter may sum in another order; on NCCL to the group.
//
// Note [Sharded gradients]
// A sharded bucket's gradients are read from the bucket only (its reduce-scatter), never from
// param.grad again (reading .grad before the update is refused; after it, .grad is None or
// zeros), so once a gradient is copied into its slot the Reducer lets go of param.grad (without
// gradient_as_bucket_view): at the end of backward a rank holds the gradients once, in the
// buckets, where torch DDP holds them twice (.grad and bucket). Parameters marked unused keep
// theirs (a stale .grad is what the step uses for a parameter unused on every rank, as torch's).
//
// Note [Released bucket buffers]
// A sharded bucket's buffer is needed from its first gradient in backward until its parameters
// are written from it in the next forward: it is the reduce-scatter's input, then the
// parameters' all-gather target. So the sharded optimizer releases each bucket's buffer once
// its parameters are written (release_bucket_buffer), and mark_ready acquires it again at the
// bucket's first gradient of the next backward: through the forward, where activations pile
// up, a rank holds its 1/N shards of the gradients, not the buckets. The storage is emptied
// and refilled in place, so every view of it (slots, the optimizer's pieces) stays valid with
// no rebinding; the padding is zeroed again, the slots are written before they are read. Not
// with gradient_as_bucket_view: the .grad tensors are views of the buffer.
//
// Note [Lazy bucket allocation]
// lazy_bucket_allocation (torch DDP's from torch 2.15; pyreducer's on every torch): as in torch
// DDP, the Reducer holds a dense bucket's memory only while a backward needs it. When a plan is
// installed and once a bucket is written back (end of backward, or Note [Deferred completion]),
// it gets a new buffer without memory (renew_buffer in bucket.h); mark_ready gives it memory at
// its first gradient. The old buffer dies with its last holder: at once, or with
// gradient_as_bucket_view when its .grad views go (zero_grad(set_to_none=True)); a .grad viewing
// it is copied into the new buffer and made its view, as any .grad not its slot's view. Not when
// sharded: the sharded optimizer releases its buckets (Note [Released bucket buffers]).
//
// Note [Deferred completion]
// With deferred completion on (an overlapped optimizer, pyreducer/overlap/optimizer.py),
// finalize_backward checks and launches as usual but does not wait: the buckets' reductions stay in
// flight past the end of backward, and complete_bucket(b) later waits for bucket b and writes its
// averages into param.grad, bucket by bucket, while the next forward runs. Until every bucket is
// completed, nothing that would touch them may run: prepare_for_backward, a rebuild, a new plan
// and a joined rank's shadow complete what is left first; a gradient arriving meanwhile (a
// backward through a graph the wrapper's forward did not make) raises.
//
// Note [Launch order]
// A bucket may be all-reduced in chunks: chunks_[b] all-reduces of consecutive, near-equal
// element ranges of its buffer (chunk k: elements [n*k/c, n*(k+1)/c)); 1 by default. The
// chunks are launched in launch_order_, a sequence in which bucket b appears chunks_[b] times
// (its k-th appearance is its chunk k). By default it is index order, one chunk each (torch
// DDP's: buckets are indexed in the order their gradients are expected). The k-th entry
// launches once its bucket is full and the (k-1)-th has launched, so every rank issues the same
// collectives in the same order whatever its timing; a bucket full before those ahead of it in
// the sequence is held back. An overlapped optimizer uses this to serve the next forward first
// (pyreducer/overlap/optimizer.py, pyreducer/overlap/schedule.py): a few chunks of the buckets full
// early keep the link busy during backward, then the first layers' buckets, full last, go ahead of
// the rest. A bucket is complete when all its chunks are. Chunks take element ranges of one
// SUM all-reduce, so with 2 ranks the sums are those of the whole bucket, bit for bit (with
// more, the backend's summation order may follow the chunk's size, within float rounding).
// A communication hook sees whole buckets: with one, every bucket has one chunk.
//
// Note [Bucket rebuild]
// As torch DDP does, one backward records the order in which gradients become ready (the first
// synced one, or the second with static_graph); the next forward with grad enabled calls
// rebuild_buckets(), which broadcasts rank 0's order and re-plans the buckets along it, so every
// rank gets the same buckets. With gradient_as_bucket_view, gradients (e.g. accumulated under
// no_sync) are copied into the new buckets before the old ones are dropped: nothing is lost.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "bucket.h"
#include "bucketing.h"
#include "comm.h"
#include "comm_hook.h"
#include "device_timeline.h"
#include "graph.h"
#include "ring.h"
#include "timeline.h"

namespace pyreducer {

// The Reducer's options. Each default is stated here once; the Python wrapper reads the ones it
// exposes from a default-constructed ReducerOptions (bindings.cpp).
struct ReducerOptions {
  bool find_unused_parameters = false;  // see Note [Unused parameters]
  bool static_graph = false;
  bool gradient_as_bucket_view = false;  // param.grad aliases its bucket slot
  // Re-plan the buckets once along the observed ready order (see Note [Bucket rebuild]), with
  // these caps (see assign_buckets). torch DDP does unless find_unused_parameters is set
  // without static_graph, or (pyreducer) a plan was given.
  bool rebuild_buckets = true;
  std::vector<int64_t> rebuild_caps_bytes{kDefaultFirstBucketCapBytes, kDefaultBucketCapBytes};
  // Copy a bucket's gradients in one fused pass when its last gradient arrives (torch DDP's
  // batched_grad_copy), instead of one copy per gradient as each arrives.
  bool batched_grad_copy = false;
  // torch DDP's lazy_bucket_allocation: see Note [Lazy bucket allocation].
  bool lazy_bucket_allocation = false;
  // Iterations kept by the timeline (see Note [Timeline]); 0 = no recording.
  size_t timeline_iterations = 8;
  // Parameters (indices) that produce sparse gradients; see Note [Sparse gradients].
  std::vector<int64_t> sparse_params;
  // torch DDP's skip_all_reduce_unused_params: with unused parameters known (find_unused_parameters
  // or static_graph), a bucket whose parameters are all unused on this rank is not all-reduced,
  // and its gradients are not written back. Every rank must find the same parameters unused.
  // As in torch DDP, with gradient_as_bucket_view an unused parameter whose .grad already is
  // its bucket view was divided in place when marked ready, before the skip was known.
  bool skip_all_reduce_unused_params = false;
  // See Note [Finite check]: a NaN or Inf in a reduced gradient is an error on every rank.
  bool check_finite = false;
};

// What torch DDP's logger reports of one synced backward (pyreducer/wrapper/ddp_logging.py turns it
// into _get_ddp_logging_data()). Times on the host's clock (Timeline::now_ns); 0: did not happen.
struct BackwardStats {
  int64_t iteration = 0;          // the synced iteration (1-based) this backward belonged to
  int64_t backward_start_ns = 0;  // prepare_for_backward: the forward's end (torch's
                                  // kBackwardComputeStart)
  int64_t comm_start_ns = 0;      // the first bucket launched
  int64_t backward_end_ns = 0;    // the end-of-backward callback started (compute is over)
  int64_t comm_end_ns = 0;        // every gradient written back
  int64_t buckets_reduced = 0;    // buckets launched as they filled (torch counts neither skipped
                                  // buckets nor the static graph's first, all-at-once, iteration)
  std::vector<int64_t> ready_order;  // parameter indices in the order their hooks fired
  std::vector<int64_t> unused;       // parameters found unused (marked ready at backward start)
};

// Owned through a shared_ptr (create()): the output sink and the end-of-backward callback hold
// weak references, so a graph that outlives its Reducer finds it gone instead of dangling.
class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // Builds the buckets of `initial_plan` (see make_buckets) and hooks every parameter's
  // AccumulateGrad node. `param_names[i]` names `params[i]` in errors. Python thread, once.
  static std::shared_ptr<Reducer> create(std::vector<at::Tensor> params,
                                         std::vector<std::string> param_names,
                                         const std::vector<std::vector<int64_t>>& initial_plan,
                                         ProcessGroupPtr group, ReducerOptions options);

  // Removes the hooks. Must not run during a backward that uses these parameters.
  ~Reducer();

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Arms the reducer (see Note [Reducer iteration]) and returns `outputs` threaded through the
  // sink node (same values; the caller returns these to the user). Called at the end of a
  // forward with grad enabled and gradient sync on. Throws if the previous synced backward was
  // interrupted after it had launched collectives. Python thread.
  std::vector<at::Tensor> prepare_for_backward(const std::vector<at::Tensor>& outputs);

  // Replaces the bucket plan (launch order; see make_buckets) between iterations; cancels a
  // pending rebuild. Every rank must apply the same plan at the same point. Python thread.
  void apply_plan(const std::vector<std::vector<int64_t>>& plan);

  // Installs a communication hook (see Note [Communication hooks]). Only before the first synced
  // iteration, and once. Python thread.
  void register_comm_hook(std::shared_ptr<CommHook> hook);

  // Sparse buckets are all-reduced on `backend` (over the group's ranks, in its rank order)
  // instead of the group; null: on the group. See Note [Sparse gradients beside Gloo's race].
  // Between iterations, the same on every rank. Python thread.
  void set_sparse_backend(BackendPtr backend);

  // See Note [Sharded buckets]: on, buckets are reallocated padded, with shards reduce-scattered
  // by `ring` if given (Note [Ring collectives on Gloo]), else on `backend` (null: the group);
  // off, as before; a pending rebuild stays. Between iterations with nothing pending, the same
  // on every rank (std::runtime_error with a hook, sparse gradients or chunks). Python thread.
  void set_sharded(bool sharded, BackendPtr backend,
                   std::shared_ptr<RingCollectives> ring = nullptr);
  // Each bucket's shard (see Note [Sharded buckets]): valid once the bucket is completed, until
  // the next backward reaches it; undefined tensors when sharding is off.
  std::vector<at::Tensor> shard_buffers() const;
  // See Note [Released bucket buffers]: gives back bucket b's buffer memory until the next
  // backward copies a gradient into it (or acquire_bucket_buffer); false (kept) with
  // gradient_as_bucket_view, whose .grad views need it. Only with sharding on and b's reduction
  // completed: std::logic_error naming what differs else. Python thread, between backward and
  // the next forward's end.
  bool release_bucket_buffer(size_t b);
  // Bucket b's buffer memory again, if released (padding zeroed, slots undefined until
  // written). Python thread.
  void acquire_bucket_buffer(size_t b);
  // Parameters (indices) found unused on every rank by the last completed synced backward (with
  // find_unused_parameters): their gradients were not written, and a sharded step skips them.
  std::vector<int64_t> globally_unused() const;

  // For a rank that has joined (join.py: out of data while others train): issues exactly the
  // collectives of one synced backward of the training ranks, with zeroed buckets (this rank
  // contributes nothing): each bucket's all-reduce, or the communication hook on it when one is
  // registered (so dtypes and collective counts match: torch DDP also runs the hook on zeroed
  // buckets), then the used-map all-reduce where the training ranks issue one. Waits for them;
  // param.grad is left untouched (with gradient_as_bucket_view on zeroed stand-in buckets). If no ready order was recorded yet, takes parameter order, so
  // this rank joins the next rebuild as the others do. Python thread, between iterations.
  void shadow_backward();

  // Records that a forward ran without arming (no_sync or grad disabled). Python thread.
  void note_unsynced_forward();

  // torch DDP's _set_static_graph(): static_graph from now on; `rebuild`: rebuild the buckets
  // along the ready order once (as torch DDP, unless a plan was given). Only before the first
  // synced forward: std::runtime_error with torch's message otherwise. Python thread.
  void set_static_graph(bool rebuild);

  // join(divide_by_initial_world_size=False): the next synced backward divides by `ranks`, the
  // number of ranks still training, instead of the world size. Python thread, before that
  // iteration's prepare_for_backward.
  void divide_next_backward_by(int64_t ranks);

  // Synced forwards so far (torch DDP's num_iterations_).
  int64_t num_iterations() const;

  // Synced backwards ended so far (a joined rank's shadow counts too); a synced forward
  // without its backward (an evaluation with grad on) counts in num_iterations alone.
  int64_t num_backwards() const;

  // See Note [Deferred completion]. Turning it off completes what is pending. `on_deferred`
  // (may be empty) runs at the end of each backward that left reductions pending, on the
  // autograd thread, outside the Reducer's lock. Python thread, between iterations (also
  // after a forward whose backward has not started); std::runtime_error during a backward.
  void set_deferred_completion(bool deferred, std::function<void()> on_deferred = {});

  // `context(phase)` is called when a collective fails in backward (from the thread that saw it,
  // without the Reducer's lock; it may take the GIL), and its text is appended to the error:
  // which ranks were lost (pyreducer/wrapper/failures.py). Python thread, once.
  void set_failure_context(std::function<std::string(const std::string&)> context);

  // Waits for bucket b's reduction (bounded by the process group's timeout) and writes its
  // averaged gradients into param.grad; nothing if it is not pending. Python thread.
  void complete_bucket(size_t b);

  // complete_bucket for every pending bucket, in launch order. Python thread.
  void complete_all();

  // Buckets whose reduction is launched and not completed yet (deferred completion only).
  std::vector<int64_t> pending_buckets() const;

  // Whether the deferred iteration's all-reduce of the used-parameter map is launched and not
  // waited for yet: complete_bucket waits for it only for a bucket that holds a parameter unused
  // on this rank, and the last completion waits for it (Note [Unused parameters]).
  bool used_map_pending() const;

  // See Note [Launch order]: `chunks[b]` (empty: 1 each) all-reduces for bucket b, launched in
  // `order`, where bucket b appears chunks[b] times; the same on every rank. A new plan resets
  // both to index order, one chunk each. Python thread, between iterations (or after a forward
  // whose backward never ran). std::invalid_argument, naming the bucket, if a count is below
  // 1 or above the bucket's element count, is not 1 for a sparse bucket or with a communication
  // hook, or `order` does not hold each bucket that many times.
  void set_launch_order(const std::vector<int64_t>& order,
                        const std::vector<int64_t>& chunks = {});
  std::vector<int64_t> launch_order() const;
  std::vector<int64_t> launch_chunks() const;  // chunks per bucket
  bool has_comm_hook() const;
  // Bucket plans installed so far, minus one (a timeline record's plan_version): it changes
  // with every rebuild or apply_plan, even to the same buckets.
  int64_t plan_version() const;
  // Whether the plan in force is provisional: the rebuild along the observed ready order (see
  // Note [Bucket rebuild]) is still to come. Any thread. pyreducer/compiled runs a compiled
  // model eagerly until then, so the rebuild observes a real order and the compile sees the
  // final buckets.
  bool rebuild_pending() const;

  // The last synced backward that finished (see BackwardStats).
  BackwardStats last_backward_stats() const;

  // The message of the last error this Reducer raised ("" if none), for the logging data.
  std::string last_error() const;

  // See Note [Bucket rebuild]. Called at the start of every forward with grad enabled, on every
  // rank; returns true if it rebuilt (once per Reducer). Collective when it rebuilds.
  bool rebuild_buckets();

  // The hook body: parameter `index` has its gradient in param.grad. Autograd thread, no GIL.
  void autograd_hook(size_t index);

  // The sink node's backward: the outer backward has started; begins the iteration's backward
  // if this one will accumulate into any parameter. One that accumulates into none (a gradient
  // penalty's torch.autograd.grad w.r.t. the inputs) is not the iteration's: as in torch DDP,
  // the reducer stays armed for the backward that follows. Autograd thread, no GIL.
  void on_backward_start();

  // End-of-backward callback queued on the autograd engine. Autograd thread, no GIL.
  void finalize_backward();

  // Snapshot of the bucket plan: parameter indices per bucket (launch order), and bytes.
  std::vector<std::vector<int64_t>> plan() const;
  std::vector<int64_t> bucket_sizes_bytes() const;
  std::vector<at::Tensor> bucket_buffers() const;  // the flat buffers (inspection, memory tests)
  int64_t world_size() const { return world_size_; }
  bool armed() const;

  // The last `last` completed iterations, oldest first (see Note [Timeline]). With a device
  // timeline, their times are the device's (see Note [Device timeline]): reading them waits for
  // the slots' events (at most 30 s), outside the Reducer's lock. All records of one call are on
  // one clock: those whose device times cannot be read are left out, and if none can be, all
  // come on the host's clock. Python thread (without the GIL).
  std::vector<IterationTimes> timeline(size_t last) const;

 private:
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> param_names,
          const std::vector<std::vector<int64_t>>& initial_plan, ProcessGroupPtr group,
          ReducerOptions options);

  // All private methods require mutex_.
  bool dynamic_find_unused() const { return options_.find_unused_parameters && !options_.static_graph; }
  bool all_unused(const Bucket& bucket) const;
  void set_unused(std::vector<size_t> unused);
  void mark_sparse_ready(size_t index, Bucket& bucket);
  bool static_first_iteration() const { return options_.static_graph && num_iterations_ == 1; }
  bool static_after_first_iteration() const { return options_.static_graph && num_iterations_ > 1; }
  void begin_backward();
  void finalize();  // finalize_backward's body
  void on_gradient(size_t index);  // autograd_hook's body
  void mark_ready(size_t index);
  void note_ready(size_t index);
  void copy_into_slot(size_t index, at::Tensor& slot);
  void launch_ready_buckets();
  void launch_chunk(size_t b);  // bucket b's next chunk (its only one with a hook)
  // Launches bucket b's chunk `chunk` of `chunks` (elements `flat`): an all-reduce, or a reduce-
  // scatter into its shard (Note [Sharded buckets]), into bucket.works (or bucket.ring_job).
  void launch_reduction(size_t b, at::Tensor& flat, size_t chunk, size_t chunks, StampPtr done);
  void copy_bucket_in(size_t b);  // batched_grad_copy: the whole bucket at once
  void launch_used_map_allreduce();
  bool all_locally_used() const;
  void wait_and_copy_out();
  // reducer_wait.cpp: the result in bucket.flat (a hook's checked); the done time into the
  // record it was launched in, if still in its slot (Note [Completion stamps] in timeline.h).
  void wait_bucket(size_t b);
  void take_hook_result(size_t b);
  void record_done(size_t b);
  void copy_out_bucket(size_t b);  // bucket.flat into param.grad (see Note [Reducer iteration])
  void note_local_finite(Bucket& bucket);  // See Note [Finite check]
  void note_reduced_finite(size_t b);       // after wait_bucket(b), before copy_out_bucket(b)
  std::string check_finite_reduced();      // the error naming parameters and ranks, or ""
  void adopt_grads_into_buckets();
  // See Note [Lazy bucket allocation]: a new buffer without memory for the bucket
  // (renew_buffer in bucket.h), if lazy allocation applies and nothing is in flight on it.
  void renew_lazily(Bucket& bucket);
  void install_plan(const std::vector<std::vector<int64_t>>& plan);  // rebuild or apply_plan
  void reset_iteration(bool keep_reductions = false);  // keep: see Note [Deferred completion]
  void defer_reductions();
  void complete_locked(size_t b);
  void complete_all_locked();
  void resolve_used_map();  // the used map of a deferred iteration, once: globally_unused_
  // See Note [Streams of a bucket].
  void note_copy_stream(Bucket& bucket);
  void note_wait_stream(Bucket& bucket);  // the current stream, into bucket.wait_streams
  void wait_for_copy_streams(Bucket& bucket);
  // The device timeline while an iteration is being recorded, else null.
  DeviceTimeline* device_recording() const { return record_ ? device_timeline_.get() : nullptr; }
  std::string describe_unready(size_t max_names) const;
  // The error for a backward that ended with unreduced buckets (torch DDP's words first).
  std::string unready_error() const;
  void check_gradient(size_t index, const at::Tensor& grad, const at::Tensor& slot) const;
  [[noreturn]] void fail(const std::string& message);  // resets the iteration, then throws
  template <typename Fn>
  void noting_errors(Fn&& fn) {  // runs fn; an exception's message becomes last_error_
    try {
      fn();
    } catch (const std::exception& error) {
      last_error_ = error.what();
      throw;
    }
  }

  std::vector<at::Tensor> params_;
  std::vector<std::string> param_names_;
  BucketSet set_;
  ProcessGroupPtr group_;
  bool sharded_ = false;       // See Note [Sharded buckets]
  BackendPtr shard_backend_;   // null: reduce-scatters on group_
  std::shared_ptr<RingCollectives> shard_ring_;  // non-null: reduce-scatters in rings
  // null: sparse buckets on group_ (Note [Sparse gradients beside Gloo's race])
  BackendPtr sparse_backend_;
  ReducerOptions options_;
  int64_t world_size_ = 1;
  std::vector<uint8_t> sparse_;  // per parameter; see Note [Sparse gradients]
  int64_t divisor_ = 1;          // this iteration's: the world size, or the training ranks
  int64_t next_divisor_ = 0;     // divide_next_backward_by; 0: the world size
  double grad_scale_ = 1.0;      // this iteration's copy-in scale: 1 / divisor_, 1 with a hook

  std::shared_ptr<CommHook> comm_hook_;  // null: SUM all-reduce with 1/world_size in copy-in

  std::unique_ptr<GradHooks> hooks_;  // on the parameters' AccumulateGrad nodes

  mutable std::mutex mutex_;
  // Per iteration (see Note [Reducer iteration]).
  bool armed_ = false;
  bool finalize_queued_ = false;
  bool backward_started_ = false;
  bool finalized_since_forward_ = false;
  size_t next_launch_ = 0;            // launch_order_[0, next_launch_) are launched
  std::vector<int64_t> launch_order_;  // See Note [Launch order]: buckets, once per chunk
  std::vector<int64_t> chunks_;        // per bucket: its all-reduces (1, or more without hook)
  std::vector<uint8_t> ready_;  // per parameter
  size_t num_ready_ = 0;
  int64_t num_iterations_ = 0;  // synced forwards so far
  int64_t num_backwards_ = 0;  // synced backwards ended so far

  // Unused parameters (see Note [Unused parameters]).
  std::vector<size_t> unused_;          // marked ready at backward start (is_unused_ below)
  std::vector<int32_t> locally_used_;   // defined gradient since the last synced step
  at::Tensor used_map_;                 // its all-reduced copy (int32, on the params' device)
  WorkPtr used_map_work_;
  std::vector<uint8_t> globally_unused_;
  std::vector<int64_t> hook_counts_;    // static graph: hook firings in the first iteration
  std::vector<int64_t> countdown_;      // static graph: firings still expected this iteration
  std::vector<uint8_t> is_unused_;      // unused_, per parameter

  // Timeline (see Note [Timeline]).
  Timeline timeline_;
  IterationRecord* record_ = nullptr;  // this iteration's, while one is being recorded
  std::unique_ptr<DeviceTimeline> device_timeline_;  // CUDA builds, CUDA parameters only
  std::vector<std::vector<std::vector<int64_t>>> plan_history_;  // [plan_version] -> plan

  // Deferred completion (see Note [Deferred completion]).
  bool deferred_ = false;
  std::function<void()> on_deferred_;
  std::vector<uint8_t> awaiting_;  // per bucket: launched, not completed
  size_t num_awaiting_ = 0;
  WorkPtr deferred_used_map_work_;  // the used-map all-reduce of the deferred iteration
  bool deferred_need_used_map_ = false;
  std::vector<uint8_t> bucket_needs_used_map_;  // per bucket: holds a parameter unused here

  // Failures of collectives in backward (see set_failure_context).
  std::function<std::string(const std::string&)> failure_context_;
  std::string failure_phase_;  // where the last one was seen

  // Logging data (see BackwardStats).
  BackwardStats stats_;       // the iteration in progress
  BackwardStats last_stats_;  // the last one that finished
  std::string last_error_;

  // Bucket rebuild (see Note [Bucket rebuild]).
  bool rebuild_pending_ = false;
  bool ready_order_complete_ = false;
  std::vector<int64_t> ready_order_;
};

}  // namespace pyreducer
