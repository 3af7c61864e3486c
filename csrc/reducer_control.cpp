// The Reducer between iterations: the Python thread's calls that configure it (communication
// hooks, static graph, the join divisor), a joined rank's shadow backward, and what it reports
// (iterations, the last backward's stats, the last error, the words of the error for gradients
// left unreduced). The iteration itself is in
// reducer.cpp (see Note [Reducer iteration]), its bucket I/O in reducer_buckets.cpp.
#include "reducer.h"

#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace pyreducer {

namespace {

// Zeroes the buckets for shadow_backward. With gradient_as_bucket_view the buckets are this
// rank's param.grad: it swaps in zeroed stand-ins instead (views laid out as the real ones, for
// hooks), and the real buffers back when it goes out of scope (as torch's zeros_like buckets).
class ZeroedBuckets {
 public:
  ZeroedBuckets(std::vector<Bucket>& buckets, const std::vector<at::Tensor>& params,
                bool stand_ins)
      : buckets_(buckets) {
    for (Bucket& bucket : buckets_) {
      if (bucket.sparse) {  // no buffer between iterations: an empty sparse gradient stands in
        const at::Tensor& param = params[bucket.param_indices.front()];
        std::vector<int64_t> dense_sizes(param.sizes().begin() + 1, param.sizes().end());
        dense_sizes.insert(dense_sizes.begin(), 0);
        bucket.flat = at::sparse_coo_tensor(at::empty({1, 0}, param.options().dtype(at::kLong)),
                                            at::empty(dense_sizes, param.options()),
                                            param.sizes());
        continue;
      }
      if (!stand_ins) {
        acquire_buffer(bucket);  // (if released: Note [Lazy bucket allocation])
        bucket.flat.zero_();
        continue;
      }
      saved_.emplace_back(bucket.flat, bucket.views);
      bucket.flat = at::zeros_like(bucket.flat);
      for (size_t k = 0; k < bucket.views.size(); ++k) {
        const at::Tensor& real = saved_.back().second[k];
        bucket.views[k] = bucket.flat.as_strided(real.sizes(), real.strides(), bucket.offsets[k]);
      }
    }
  }
  ~ZeroedBuckets() {
    size_t next = 0;  // saved_ holds the dense buckets' buffers, in bucket order
    for (Bucket& bucket : buckets_) {
      if (bucket.sparse) {
        bucket.flat = at::Tensor();
      } else if (next < saved_.size()) {
        bucket.flat = std::move(saved_[next].first);
        bucket.views = std::move(saved_[next].second);
        next += 1;
      }
    }
  }
  ZeroedBuckets(const ZeroedBuckets&) = delete;
  ZeroedBuckets& operator=(const ZeroedBuckets&) = delete;

 private:
  std::vector<Bucket>& buckets_;
  std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> saved_;
};

}  // namespace

bool Reducer::armed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return armed_;
}

int64_t Reducer::num_iterations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return num_iterations_;
}

int64_t Reducer::num_backwards() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return num_backwards_;
}

BackwardStats Reducer::last_backward_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_stats_;
}

std::string Reducer::last_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_error_;
}

void Reducer::set_static_graph(bool rebuild) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (num_iterations_ > 0) {
    last_error_ = "set_static_graph() should be called before training loop starts and after "
                  "DistributedDataParallel is constructed.";
    throw std::runtime_error(last_error_ + " (pyreducer: " + std::to_string(num_iterations_) +
                             " synced iteration(s) already ran on rank " +
                             std::to_string(group_->getRank()) + ")");
  }
  options_.static_graph = true;
  if (rebuild && !ready_order_complete_) rebuild_pending_ = true;
}

void Reducer::divide_next_backward_by(int64_t ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (ranks < 1 || ranks > world_size_) {
    throw std::invalid_argument("pyreducer: expected between 1 and " +
                                std::to_string(world_size_) + " training ranks, got " +
                                std::to_string(ranks));
  }
  next_divisor_ = ranks;
}

void Reducer::set_sparse_backend(BackendPtr backend) {
  std::lock_guard<std::mutex> lock(mutex_);
  sparse_backend_ = std::move(backend);
}

bool Reducer::used_map_pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(deferred_used_map_work_);
}

std::vector<int64_t> Reducer::pending_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> pending;
  for (size_t b = 0; b < awaiting_.size(); ++b) {
    if (awaiting_[b]) pending.push_back(static_cast<int64_t>(b));
  }
  return pending;
}

void Reducer::set_deferred_completion(bool deferred, std::function<void()> on_deferred) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Read when a backward ends: armed by a forward whose backward has not started is fine.
  if (finalize_queued_ || backward_started_ || num_ready_ > 0) {
    throw std::runtime_error("pyreducer: deferred completion can only be switched between "
                             "iterations (not during a backward or before its end)");
  }
  if (!deferred) complete_all_locked();
  deferred_ = deferred;
  on_deferred_ = deferred ? std::move(on_deferred) : std::function<void()>();
}

void Reducer::set_sharded(bool sharded, BackendPtr backend,
                          std::shared_ptr<RingCollectives> ring) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finalize_queued_ || backward_started_ || num_ready_ > 0 || num_awaiting_ > 0) {
    throw std::runtime_error("pyreducer: sharding can only be switched between iterations, with "
                             "no reduction pending");
  }
  if (sharded && comm_hook_) {
    throw std::runtime_error("pyreducer: sharded buckets are reduce-scattered, but the "
                             "communication hook " + comm_hook_->name() + " all-reduces them");
  }
  for (size_t i = 0; sharded && i < sparse_.size(); ++i) {
    if (sparse_[i]) {
      throw std::runtime_error("pyreducer: sharded buckets cannot hold " + param_names_[i] +
                               ", which produces sparse gradients");
    }
  }
  const bool rebuild = rebuild_pending_;
  const std::vector<int64_t> ready_order = ready_order_;
  std::vector<std::vector<int64_t>> plan;
  for (const Bucket& bucket : set_.buckets) plan.push_back(bucket.param_indices);
  sharded_ = sharded;
  shard_backend_ = sharded ? std::move(backend) : BackendPtr();
  shard_ring_ = sharded ? std::move(ring) : nullptr;
  install_plan(plan);  // the same buckets, padded (or not), launch order reset
  rebuild_pending_ = rebuild;
  ready_order_ = ready_order;
}

std::vector<at::Tensor> Reducer::shard_buffers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> shards;
  for (const Bucket& bucket : set_.buckets) shards.push_back(bucket.shard);
  return shards;
}

bool Reducer::release_bucket_buffer(size_t b) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (b >= set_.buckets.size()) {
    throw std::out_of_range("release_bucket_buffer: bucket " + std::to_string(b) + " of " +
                            std::to_string(set_.buckets.size()));
  }
  Bucket& bucket = set_.buckets[b];
  if (!sharded_ || !bucket.works.empty() || bucket.ring_job) {
    throw std::logic_error("pyreducer: bucket " + std::to_string(b) + "'s buffer can be "
                           "released only when sharded (is " + std::to_string(sharded_) +
                           ") with no reduction in flight (" +
                           std::to_string(bucket.works.size() + (bucket.ring_job ? 1 : 0)) +
                           " in flight)");
  }
  if (options_.gradient_as_bucket_view) return false;
  if (!bucket.flat.device().is_cpu()) {  // (as install_plan frees buffers; compiled, not run)
    for (const c10::Stream& stream : bucket.wait_streams) bucket.flat.record_stream(stream);
  }
  release_buffer(bucket);
  return true;
}

void Reducer::renew_lazily(Bucket& bucket) {
  if (!options_.lazy_bucket_allocation || sharded_ || bucket.sparse || bucket.released ||
      !bucket.flat.defined() || !bucket.works.empty() || bucket.future || bucket.ring_job) {
    return;
  }
  if (!bucket.flat.device().is_cpu()) {  // (as install_plan frees buffers; compiled, not run)
    for (const c10::Stream& stream : bucket.wait_streams) bucket.flat.record_stream(stream);
  }
  renew_buffer(bucket);
}

void Reducer::acquire_bucket_buffer(size_t b) {
  std::lock_guard<std::mutex> lock(mutex_);
  acquire_buffer(set_.buckets.at(b));
}

std::vector<int64_t> Reducer::globally_unused() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> unused;
  for (size_t i = 0; i < globally_unused_.size(); ++i) {
    if (globally_unused_[i]) unused.push_back(static_cast<int64_t>(i));
  }
  return unused;
}

void Reducer::register_comm_hook(std::shared_ptr<CommHook> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (sharded_) {
    throw std::runtime_error("pyreducer: a communication hook all-reduces buckets, but they are "
                             "sharded (reduce-scattered: see Note [Sharded buckets])");
  }
  if (comm_hook_) {
    throw std::runtime_error(
        "register_comm_hook or register_builtin_comm_hook can only be called once. (pyreducer: " +
        comm_hook_->name() + " is already registered)");
  }
  if (num_iterations_ > 0) {
    throw std::runtime_error("pyreducer: register_comm_hook must be called before the first "
                             "synced forward (as in torch DDP); " +
                             std::to_string(num_iterations_) + " iteration(s) already ran");
  }
  for (size_t b = 0; b < chunks_.size(); ++b) {
    if (chunks_[b] != 1) {
      throw std::runtime_error("pyreducer: a communication hook sees whole buckets, but the "
                               "launch order splits bucket " + std::to_string(b) + " into " +
                               std::to_string(chunks_[b]) + " chunks (see Note [Launch order])");
    }
  }
  comm_hook_ = std::move(hook);  // the hook averages: copy-in does not scale (prepare_for_backward)
}

void Reducer::shadow_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  complete_all_locked();  // See Note [Deferred completion]
  if (armed_ || finalize_queued_) {
    throw std::logic_error("pyreducer: shadow_backward called while a backward is pending");
  }
  num_iterations_ += 1;  // as the training ranks' synced forward counts it
  num_backwards_ += 1;  // ... and their backward
  const bool used_map = dynamic_find_unused() || static_first_iteration();
  at::NoGradGuard no_grad;
  try {
    const ZeroedBuckets zeroed(set_.buckets, params_, options_.gradient_as_bucket_view);
    for (int64_t b : launch_order_) {  // as the training ranks launch them, chunk by chunk
      launch_chunk(static_cast<size_t>(b));  // record_ is null: nothing is recorded
    }
    if (used_map) {
      std::fill(locally_used_.begin(), locally_used_.end(), 0);
      launch_used_map_allreduce();
    }
    for (size_t b = 0; b < set_.buckets.size(); ++b) wait_bucket(b);
    if (used_map) wait_or_throw(used_map_work_, group_, "all-reduce of the used-parameter map");
  } catch (...) {
    reset_iteration();
    throw;
  }
  reset_iteration();
  for (Bucket& bucket : set_.buckets) renew_lazily(bucket);  // Note [Lazy bucket allocation]
  // As finalize_backward: the order is taken when a training rank's backward would record it.
  if (rebuild_pending_ && !ready_order_complete_ && !static_first_iteration()) {
    ready_order_.clear();
    for (size_t i = 0; i < params_.size(); ++i) ready_order_.push_back(static_cast<int64_t>(i));
    ready_order_complete_ = true;
  }
}

void Reducer::note_unsynced_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  finalized_since_forward_ = false;
}


void Reducer::set_launch_order(const std::vector<int64_t>& order,
                               const std::vector<int64_t>& chunks) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Armed by a forward whose backward never came is fine: nothing was launched.
  if (finalize_queued_ || backward_started_ || num_ready_ > 0) {
    throw std::runtime_error("pyreducer: a launch order can only be set between iterations");
  }
  const size_t count = set_.buckets.size();
  std::vector<int64_t> counts = chunks.empty() ? std::vector<int64_t>(count, 1) : chunks;
  if (counts.size() != count) {
    throw std::invalid_argument("launch order: expected a chunk count for each of the " +
                                std::to_string(count) + " buckets, got " +
                                std::to_string(counts.size()));
  }
  for (size_t b = 0; b < count; ++b) {
    const Bucket& bucket = set_.buckets[b];
    const int64_t most =
        (bucket.sparse || comm_hook_ || sharded_) ? 1 : std::max<int64_t>(1, bucket.flat.numel());
    if (counts[b] < 1 || counts[b] > most) {
      throw std::invalid_argument(
          "launch order: bucket " + std::to_string(b) + " can be split into 1 to " +
          std::to_string(most) + " chunks" +
          (bucket.sparse      ? " (sparse)"
           : comm_hook_     ? " (a communication hook sees whole buckets)"
           : sharded_       ? " (sharded: one reduce-scatter per bucket)"
                            : " (its element count)") +
          ", got " + std::to_string(counts[b]));
    }
  }
  std::vector<int64_t> seen(count, 0);
  for (int64_t b : order) {
    if (b < 0 || b >= static_cast<int64_t>(count)) {
      throw std::invalid_argument("launch order: bucket " + std::to_string(b) +
                                  " is out of range (" + std::to_string(count) + " buckets)");
    }
    seen[b] += 1;
  }
  for (size_t b = 0; b < count; ++b) {
    if (seen[b] != counts[b]) {
      throw std::invalid_argument("launch order: bucket " + std::to_string(b) +
                                  " must appear once per chunk, " + std::to_string(counts[b]) +
                                  " time(s), found " + std::to_string(seen[b]));
    }
  }
  launch_order_ = order;
  chunks_ = std::move(counts);
}

std::vector<int64_t> Reducer::launch_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return launch_order_;
}

bool Reducer::rebuild_pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return rebuild_pending_;
}

int64_t Reducer::plan_version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(plan_history_.size()) - 1;
}

bool Reducer::has_comm_hook() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return comm_hook_ != nullptr;
}

std::vector<int64_t> Reducer::launch_chunks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return chunks_;
}

std::string Reducer::describe_unready(size_t max_names) const {
  std::string names, indices;
  size_t count = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    if (count < max_names) {
      names += (count ? ", " : "") + param_names_[i];
      indices += (count ? " " : "") + std::to_string(i);
    }
    count += 1;
  }
  const std::string more =
      count > max_names ? " ... (" + std::to_string(count - max_names) + " more)" : "";
  const std::string rank = std::to_string(group_->getRank());
  // torch DDP's last two lines (the names: its TORCH_DISTRIBUTED_DEBUG=INFO/DETAIL form)
  return "Parameter indices which did not receive grad for rank " + rank + ": " + indices + more +
         "\nParameters which did not receive grad for rank " + rank + ": " + names + more;
}

std::string Reducer::unready_error() const {
  // torch DDP's words first, which its tests and users match on (it raises them at the next
  // forward, pyreducer at the end of this backward), then pyreducer's.
  std::string cause;
  if (options_.static_graph) {
    cause = "This error indicates that your training graph has changed in this iteration, "
            "e.g., one parameter is used in first iteration, but then got unused in the second "
            "iteration. this is not compatible with static_graph set to True.";
  } else if (options_.find_unused_parameters) {
    cause = "Since `find_unused_parameters=True` is enabled, this likely means that not all "
            "`forward` outputs participate in computing loss. You can fix this by making sure "
            "all `forward` function outputs participate in calculating loss.";
  } else {
    cause = "This error indicates that your module has parameters that were not used in "
            "producing loss. You can enable unused parameter detection by passing the keyword "
            "argument `find_unused_parameters=True` to `torch.nn.parallel."
            "DistributedDataParallel`, and by making sure all `forward` function outputs "
            "participate in calculating loss, or exclude parameters with "
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names) "
            "before wrapping.";
  }
  return "Expected to have finished reduction in the prior iteration before starting a new "
         "one. " + cause + "\n" + describe_unready(20) + "\n(pyreducer: backward on rank " +
         std::to_string(group_->getRank()) + " finished before every gradient was reduced; "
         "the gradients would be left un-averaged. torch DDP names the parameters only if you "
         "set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL; "
         "pyreducer always does.)";
}

}  // namespace pyreducer
