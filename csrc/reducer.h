// The Reducer: flat gradient buckets, autograd hooks, and in-order asynchronous all-reduce.
//
// Note [Reducer iteration]
// One synced iteration goes through these states, on every rank in the same order:
//   1. prepare_for_backward() (end of the wrapper's forward, Python thread) arms the reducer.
//   2. During backward, the post-hook on each parameter's AccumulateGrad node calls
//      mark_variable_ready(i): it copies grad * (1/world_size) into the parameter's slot and,
//      when a bucket's last slot is filled, launches every ready bucket that is next in index
//      order (all ranks launch buckets 0, 1, 2, ... in that order, so collectives match).
//      The first hook of the backward queues finalize_backward() on the autograd engine.
//   3. finalize_backward() runs when backward ends: it checks that every parameter produced a
//      gradient (else it raises, naming them), waits on every bucket's work, writes the averaged
//      gradients into param.grad, and disarms.
// While disarmed (no_sync, or a forward without grad) the hooks do nothing: gradients accumulate
// locally and the next synced backward reduces the accumulated sum.
//
// Note [Bucket rebuild]
// As torch DDP does, the first synced backward records the order in which gradients become
// ready; the next forward with grad enabled calls rebuild_buckets(), which broadcasts rank 0's
// order and re-plans the buckets along it (so every rank gets the same buckets). Bucket buffers
// never alias param.grad, so a rebuild loses nothing that no_sync() accumulated.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "bucket.h"
#include "comm.h"

namespace torch::autograd {
struct Node;
}

namespace pyreducer {

class Reducer {
 public:
  // Builds the buckets of `initial_plan` (see make_buckets) and hooks every parameter's
  // AccumulateGrad node. `param_names[i]` names `params[i]` in errors. `rebuild_caps_bytes`:
  // caps for the one rebuild after the first iteration (see assign_buckets); empty = never
  // rebuild. Called once, from the Python thread.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> param_names,
          const std::vector<std::vector<int64_t>>& initial_plan, ProcessGroupPtr group,
          std::vector<int64_t> rebuild_caps_bytes);

  // Removes the hooks. Must not run during a backward that uses these parameters.
  ~Reducer();

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Arms the reducer for the next backward (see Note [Reducer iteration]). Called at the end of
  // the wrapper's forward when grad is enabled and gradient sync is on. Throws if the previous
  // synced backward was interrupted after it had launched collectives.
  void prepare_for_backward();

  // See Note [Bucket rebuild]. Called at the start of every forward with grad enabled, on every
  // rank; returns true if it rebuilt (once per Reducer). Collective when it rebuilds.
  bool rebuild_buckets();

  // The hook body: parameter `index` has its gradient in param.grad. Autograd thread, no GIL.
  void mark_variable_ready(size_t index);

  // End-of-backward callback queued on the autograd engine. Autograd thread, no GIL.
  void finalize_backward();

  // Snapshot of the bucket plan: parameter indices per bucket (launch order), and bytes.
  std::vector<std::vector<int64_t>> plan() const;
  std::vector<int64_t> bucket_sizes_bytes() const;
  int64_t world_size() const { return world_size_; }
  bool armed() const;

 private:
  void launch_ready_buckets();  // requires mutex_
  void reset_iteration();       // requires mutex_
  std::string describe_unready(size_t max_names) const;  // requires mutex_
  void check_gradient(size_t index, const at::Tensor& grad, const at::Tensor& slot) const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> param_names_;
  BucketSet set_;
  ProcessGroupPtr group_;
  int64_t world_size_ = 1;
  double grad_scale_ = 1.0;  // 1 / world_size

  // Hooks: the accumulators are kept alive here (a parameter holds only a weak reference).
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  // Bucket rebuild (see Note [Bucket rebuild]).
  std::vector<int64_t> rebuild_caps_bytes_;
  bool rebuild_pending_ = false;
  bool ready_order_complete_ = false;
  std::vector<int64_t> ready_order_;

  mutable std::mutex mutex_;
  bool armed_ = false;
  bool finalize_queued_ = false;
  size_t next_bucket_ = 0;      // buckets [0, next_bucket_) are launched
  std::vector<uint8_t> ready_;  // per parameter, this iteration
  size_t num_ready_ = 0;
};

}  // namespace pyreducer
