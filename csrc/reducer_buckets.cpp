// The Reducer's bucket I/O: plans, rebuild, copy-in, launch, wait and copy-out.
// The iteration state machine that calls these lives in reducer.cpp (see Note [Reducer iteration]).
#include "reducer.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "bucketing.h"
#include "ops.h"

namespace pyreducer {

std::vector<std::vector<int64_t>> Reducer::plan() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<int64_t>> result;
  for (const Bucket& bucket : set_.buckets) result.push_back(bucket.param_indices);
  return result;
}

std::vector<int64_t> Reducer::bucket_sizes_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> result;
  for (const Bucket& bucket : set_.buckets) result.push_back(bucket.size_bytes);
  return result;
}

std::vector<at::Tensor> Reducer::bucket_buffers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> result;
  for (const Bucket& bucket : set_.buckets) result.push_back(bucket.flat);
  return result;
}

bool Reducer::rebuild_buckets() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!rebuild_pending_ || !ready_order_complete_) return false;
  complete_all_locked();  // the old buckets' reductions first (Note [Deferred completion])
  if (armed_ || finalize_queued_) {
    throw std::logic_error("pyreducer: rebuild_buckets called while a backward is pending");
  }
  // Parameters that never became ready (unused with static_graph) go last.
  std::vector<uint8_t> seen(params_.size(), 0);
  for (int64_t index : ready_order_) seen[index] = 1;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!seen[i]) ready_order_.push_back(static_cast<int64_t>(i));
  }
  broadcast_int64s(group_, ready_order_, /*root=*/0, params_[0].device());
  std::vector<ParamSpec> specs(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    specs[i] = ParamSpec{size_bytes(params_[i]), group_key(params_[i]), sparse_[i] != 0};
  }
  std::vector<std::vector<int64_t>> plan;
  for (BucketSpec& spec : assign_buckets(specs, ready_order_, options_.rebuild_caps_bytes)) {
    plan.push_back(std::move(spec.param_indices));
  }
  install_plan(plan);
  return true;
}

namespace {

// Adds the current stream of `device` to `streams`, once.
void add_current_stream(std::vector<c10::Stream>& streams, c10::Device device) {
  const c10::Stream current = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  if (std::find(streams.begin(), streams.end(), current) == streams.end()) {
    streams.push_back(current);
  }
}

}  // namespace

void Reducer::note_wait_stream(Bucket& bucket) {
  if (!bucket.flat.defined() || bucket.flat.device().is_cpu()) return;
  add_current_stream(bucket.wait_streams, bucket.flat.device());
}

void Reducer::note_copy_stream(Bucket& bucket) {
  const c10::Device device = bucket.flat.device();
  if (device.is_cpu()) return;  // CPU work is ordered by the hooks' own order
  add_current_stream(bucket.copy_streams, device);
}

void Reducer::wait_for_copy_streams(Bucket& bucket) {
  if (bucket.copy_streams.empty()) return;
  const c10::Device device = bucket.flat.device();
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream current = impl.getStream(device);
  for (const c10::Stream& stream : bucket.copy_streams) {
    if (stream == current) continue;
    c10::Event copied(device.type());
    copied.record(stream);  // everything enqueued on `stream` so far, the copies included
    copied.block(current);
  }
  bucket.copy_streams.assign(1, current);  // the current stream now follows all of them
}

void Reducer::copy_bucket_in(size_t b) {
  Bucket& bucket = set_.buckets[b];
  if (bucket.sparse) return;  // its gradient is the bucket (see Note [Sparse gradients])
  wait_for_copy_streams(bucket);  // gradients produced on other streams are complete first
  const double divisor = comm_hook_ ? 1.0 : static_cast<double>(divisor_);
  std::vector<at::Tensor> grads;
  std::vector<int64_t> offsets;
  for (size_t k = 0; k < bucket.param_indices.size(); ++k) {
    at::Tensor& grad = params_[bucket.param_indices[k]].mutable_grad();
    at::Tensor& view = bucket.views[k];
    if (!grad.defined()) {
      view.zero_();
    } else if (grad.is_alias_of(view)) {
      if (!comm_hook_) view.div_(divisor_);
    } else if (view.is_contiguous()) {  // the fused op writes slots in row-major order
      grads.push_back(grad);
      offsets.push_back(bucket.offsets[k]);
    } else {  // a channels-last (or otherwise strided) parameter: its view defines the layout
      divide_into(view, grad, divisor);
    }
  }
  bucket_copy_in(bucket.flat, grads, offsets, divisor);
  if (options_.gradient_as_bucket_view || sharded_) {
    for (size_t k = 0; k < bucket.param_indices.size(); ++k) {
      at::Tensor& grad = params_[bucket.param_indices[k]].mutable_grad();
      if (!grad.defined()) continue;
      if (options_.gradient_as_bucket_view) {
        grad = bucket.views[k];
      } else if (!is_unused_[bucket.param_indices[k]]) {
        let_go_of_gradient(grad);  // See Note [Sharded gradients]
      }
    }
  }
}

void Reducer::launch_ready_buckets() {
  while (next_launch_ < launch_order_.size() &&
         set_.buckets[launch_order_[next_launch_]].pending == 0) {
    const size_t b = static_cast<size_t>(launch_order_[next_launch_]);
    Bucket& bucket = set_.buckets[b];
    const bool first_chunk = bucket.chunks_launched == 0;
    if (first_chunk) {  // decided afresh every iteration (a deferred one keeps the last flag)
      // A skipped bucket is left as is, on every rank (ranks must agree on unused parameters).
      bucket.skipped = options_.skip_all_reduce_unused_params && all_unused(bucket);
    }
    if (bucket.skipped) {
      bucket.chunks_launched += 1;  // none of its chunks is all-reduced
    } else {
      launch_chunk(b);
      if (first_chunk && !static_first_iteration()) stats_.buckets_reduced += 1;
    }
    next_launch_ += 1;
  }
  if (next_launch_ == launch_order_.size() && dynamic_find_unused()) launch_used_map_allreduce();
}

void Reducer::launch_chunk(size_t b) {
  Bucket& bucket = set_.buckets[b];
  const size_t chunk = bucket.chunks_launched++;
  const auto chunks = static_cast<size_t>(chunks_[b]);
  const bool first = chunk == 0;
  const bool last = chunk + 1 == chunks;
  wait_for_copy_streams(bucket);  // See Note [Streams of a bucket]
  if (first) note_local_finite(bucket);  // See Note [Finite check]
  DeviceTimeline* device = device_recording();
  StampPtr done;  // this collective's completion time (Note [Completion stamps])
  if (armed_ && stats_.comm_start_ns == 0) stats_.comm_start_ns = Timeline::now_ns();
  if (first) {
    bucket.done_stamps.clear();
    bucket.record_iteration = record_ ? record_->iteration : -1;
  }
  if (record_) {
    if (first) {
      record_->bucket_launch_ns[b] = Timeline::now_ns();
      bucket.record_slot = record_->slot;
    }
    done = std::make_shared<CompletionStamp>();
    if (device && first) device->bucket_launch(record_->slot, b);
  }
  if (!comm_hook_) {
    // Off the CPU the profiler range marks the launch alone, named so (comm.cpp,
    // launch_timed): the NCCL kernel is on the profiler's CUDA timeline, and the device
    // timeline has the bucket's real communication time.
    at::Tensor flat = bucket.flat;
    if (chunks > 1) {  // See Note [Launch order]: chunk k of c
      const int64_t n = bucket.flat.numel();
      const int64_t begin = n * static_cast<int64_t>(chunk) / static_cast<int64_t>(chunks);
      const int64_t end = n * static_cast<int64_t>(chunk + 1) / static_cast<int64_t>(chunks);
      flat = bucket.flat.narrow(0, begin, end - begin);
    }
    launch_reduction(b, flat, chunk, chunks, done);
    if (device && last && !bucket.works.empty()) {  // one stream: the last chunk's completion follows the others'
      try {
        device->bucket_done(record_->slot, b, bucket.works.back()->getFuture());
      } catch (const std::exception&) {
        // A backend without futures: this bucket's device done time stays unrecorded.
      }
    }
    return;
  }
  GradBucketView view;
  view.index = b;
  view.is_last = static_cast<int64_t>(b) == launch_order_.back();  // the last launched
  view.buffer = bucket.flat;
  view.gradients = bucket.sparse ? std::vector<at::Tensor>{bucket.flat} : bucket.views;
  for (int64_t i : bucket.param_indices) view.parameters.push_back(params_[i]);
  bucket.future = comm_hook_->run(view);
  if (done != nullptr) {
    bucket.future->addCallback([done](c10::ivalue::Future& /*unused*/) { done->stamp(); });
  }
  bucket.done_stamps.push_back(std::move(done));
  if (device) device->bucket_done(record_->slot, b, bucket.future);
}

void Reducer::launch_reduction(size_t b, at::Tensor& flat, size_t chunk, size_t chunks,
                                StampPtr done) {
  Bucket& bucket = set_.buckets[b];
  if (sharded_ && shard_ring_) {  // See Note [Ring collectives on Gloo]; timed by its job
    bucket.ring_job = shard_ring_->reduce_scatter(flat, bucket.shard,
                                                  "reduce-scatter of bucket " + std::to_string(b));
    return;
  }
  bucket.done_stamps.push_back(done);  // works[k]'s stamp is done_stamps[k]
  if (sharded_) {  // See Note [Sharded buckets]
    auto label = [b] { return "pyreducer.reduce_scatter.bucket_" + std::to_string(b); };
    bucket.works.push_back(
        shard_backend_ ? reduce_scatter_sum_async(shard_backend_, bucket.shard, flat, done, label)
                       : reduce_scatter_sum_async(group_, bucket.shard, flat, done, label));
    return;
  }
  auto label = [b, chunk, chunks] {
    return "pyreducer.allreduce.bucket_" + std::to_string(b) +
           (chunks > 1 ? ".chunk_" + std::to_string(chunk) : std::string());
  };
  bucket.works.push_back(bucket.sparse && sparse_backend_
                             ? allreduce_sum_async(sparse_backend_, flat, done, label)
                             : allreduce_sum_async(group_, flat, done, label));
}

void Reducer::launch_used_map_allreduce() {
  at::NoGradGuard no_grad;
  const at::Tensor local = at::from_blob(locally_used_.data(),
                                         {static_cast<int64_t>(locally_used_.size())},
                                         at::TensorOptions().dtype(at::kInt));
  if (used_map_.is_cpu()) {
    used_map_.copy_(local);
  } else {
    // As torch DDP: an asynchronous copy from a pinned temporary, not a blocking copy from
    // pageable memory (which would stall this autograd thread under the lock). Staged, because
    // the copy runs in stream order and the host rewrites locally_used_ before the next backward.
    at::Tensor staged = at::empty(local.sizes(), local.options().pinned_memory(true));
    staged.copy_(local);
    used_map_.copy_(staged, /*non_blocking=*/true);
  }
  used_map_work_ = allreduce_sum_async(group_, used_map_);
}

bool Reducer::all_locally_used() const {
  return std::all_of(locally_used_.begin(), locally_used_.end(), [](int32_t u) { return u != 0; });
}

void Reducer::wait_and_copy_out() {
  // Bucket b is written back while buckets b+1.. are still in flight (as torch DDP does), except
  // with a used-map all-reduce in flight and some parameter unused on this rank: whether it keeps
  // its .grad is known only from the map, launched after the last bucket. A parameter used here
  // is used globally, so when all are, the map is not needed (nor read back to the host).
  const bool need_used_map = used_map_work_ && !all_locally_used();
  if (used_map_work_ && !need_used_map) {
    std::fill(globally_unused_.begin(), globally_unused_.end(), 0);
  }
  const bool copy_as_done = !need_used_map;
  DeviceTimeline* device = device_recording();
  if (record_) record_->wait_start_ns = Timeline::now_ns();
  if (device) device->wait_start(record_->slot);
  for (size_t b = 0; b < set_.buckets.size(); ++b) {
    wait_bucket(b);
    note_reduced_finite(b);  // See Note [Finite check]
    if (copy_as_done) copy_out_bucket(b);
  }
  if (record_) record_->wait_end_ns = Timeline::now_ns();
  if (device) device->wait_end(record_->slot);
  if (used_map_work_) {
    // Also when the map is not needed: the next iteration's copy into used_map_ must follow
    // this all-reduce (on NCCL this orders streams; the host does not wait).
    wait_or_throw(used_map_work_, group_, "all-reduce of the used-parameter map");
    used_map_work_.reset();
  }
  if (copy_as_done) return;
  const at::Tensor used = used_map_.to(at::kCPU);  // blocking: the all-reduce is done
  const int32_t* data = used.const_data_ptr<int32_t>();
  for (size_t i = 0; i < params_.size(); ++i) globally_unused_[i] = data[i] == 0;
  for (size_t b = 0; b < set_.buckets.size(); ++b) copy_out_bucket(b);
}

void Reducer::defer_reductions() {
  awaiting_.assign(set_.buckets.size(), 0);
  num_awaiting_ = 0;
  for (size_t b = 0; b < set_.buckets.size(); ++b) {
    if (set_.buckets[b].skipped) continue;
    awaiting_[b] = 1;
    num_awaiting_ += 1;
  }
  // As wait_and_copy_out: the map is needed only if some parameter was unused on this rank, and
  // then only by the buckets holding one. A parameter used here is used globally: its gradient is
  // written back whatever the map says. So a bucket of parameters all used here is completed
  // without waiting for the map, which is launched after the last bucket (else the next
  // forward's first read would wait for the whole communication).
  deferred_need_used_map_ = used_map_work_ && !all_locally_used();
  bucket_needs_used_map_.assign(set_.buckets.size(), 0);
  if (used_map_work_) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (locally_used_[i]) globally_unused_[i] = 0;
    }
    for (size_t b = 0; deferred_need_used_map_ && b < set_.buckets.size(); ++b) {
      for (int64_t index : set_.buckets[b].param_indices) {
        if (!locally_used_[index]) bucket_needs_used_map_[b] = 1;
      }
    }
  }
  deferred_used_map_work_ = std::move(used_map_work_);
}

void Reducer::resolve_used_map() {
  if (!deferred_used_map_work_) return;
  wait_or_throw(deferred_used_map_work_, group_, "all-reduce of the used-parameter map");
  deferred_used_map_work_.reset();
  if (!deferred_need_used_map_) return;
  const at::Tensor used = used_map_.to(at::kCPU);  // blocking: the all-reduce is done
  const int32_t* data = used.const_data_ptr<int32_t>();
  for (size_t i = 0; i < params_.size(); ++i) globally_unused_[i] = data[i] == 0;
}

void Reducer::complete_locked(size_t b) {
  if (b >= awaiting_.size() || !awaiting_[b]) return;
  Bucket& bucket = set_.buckets[b];
  if (deferred_need_used_map_ && bucket_needs_used_map_[b]) {
    resolve_used_map();  // which of its gradients to write back
  }
  wait_bucket(b);
  copy_out_bucket(b);
  awaiting_[b] = 0;
  num_awaiting_ -= 1;
  bucket.works.clear();
  bucket.future.reset();
  bucket.ring_job.reset();
  if (bucket.sparse) bucket.flat = at::Tensor();
  renew_lazily(bucket);  // written back: see Note [Lazy bucket allocation]
  if (num_awaiting_ == 0) {
    resolve_used_map();  // also when not needed: the next copy into used_map_ must follow it
    last_stats_.comm_end_ns = Timeline::now_ns();
    if (comm_hook_) comm_hook_->backward_ended();
  }
}

void Reducer::complete_all_locked() {
  for (size_t b = 0; b < awaiting_.size() && num_awaiting_ > 0; ++b) complete_locked(b);
}

void Reducer::complete_bucket(size_t b) {
  std::lock_guard<std::mutex> lock(mutex_);
  noting_errors([&] { complete_locked(b); });
}

void Reducer::complete_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  noting_errors([&] { complete_all_locked(); });
}

void Reducer::copy_out_bucket(size_t b) {
  at::NoGradGuard no_grad;
  Bucket& bucket = set_.buckets[b];
  // A skipped bucket leaves its gradients as they are; a sparse one was reduced in .grad itself;
  // a sharded one's sum is in no rank's whole (see Note [Sharded buckets]).
  if (bucket.skipped || bucket.sparse || sharded_) return;
  std::vector<at::Tensor> grads;  // defined gradients with row-major slots: one fused copy
  std::vector<int64_t> offsets;
  for (size_t k = 0; k < bucket.param_indices.size(); ++k) {
    const int64_t index = bucket.param_indices[k];
    if (globally_unused_[index]) continue;  // keeps its .grad as it was
    at::Tensor& param = params_[index];
    at::Tensor& grad = param.mutable_grad();
    if (options_.gradient_as_bucket_view) {
      if (!grad.defined()) grad = bucket.views[k];
    } else if (grad.defined() && bucket.views[k].is_contiguous()) {
      grads.push_back(grad);
      offsets.push_back(bucket.offsets[k]);
    } else {
      copy_out_of_slot(grad, bucket.views[k], param);
    }
  }
  bucket_copy_out(bucket.flat, grads, offsets);
}

void Reducer::adopt_grads_into_buckets() {
  if (!options_.gradient_as_bucket_view) return;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (sparse_[i]) continue;  // no buffer to adopt into
    at::Tensor& grad = params_[i].mutable_grad();
    const SlotLocation& location = set_.locations[i];
    at::Tensor& slot = set_.buckets[location.bucket].views[location.slot];
    if (grad.defined() && !grad.is_alias_of(slot)) {
      slot.copy_(grad);
      grad = slot;
    }
  }
}

void Reducer::apply_plan(const std::vector<std::vector<int64_t>>& plan) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (armed_ || finalize_queued_) {
    throw std::runtime_error("pyreducer: a bucket plan can only be applied between iterations "
                             "(not between a synced forward and its backward)");
  }
  install_plan(plan);
}

void Reducer::install_plan(const std::vector<std::vector<int64_t>>& plan) {
  complete_all_locked();  // See Note [Deferred completion]
  // The old buffers go back to the caching allocator under the stream they were allocated on;
  // only the streams that waited for their reductions are ordered after them (an NCCL wait
  // orders the current stream; under deferred completion, the stream of each bucket's first
  // read). Recorded on those, their memory is not handed to another stream's allocation before
  // those streams are past the reductions and the copy-outs. (Compiled, not run: no GPU here.)
  for (Bucket& bucket : set_.buckets) {
    if (!bucket.flat.defined() || bucket.released || bucket.flat.device().is_cpu()) continue;
    for (const c10::Stream& stream : bucket.wait_streams) bucket.flat.record_stream(stream);
  }
  // (validates before anything changes)
  set_ = make_buckets(params_, param_names_, plan, sparse_, sharded_ ? world_size_ : 0);
  launch_order_.resize(set_.buckets.size());
  std::iota(launch_order_.begin(), launch_order_.end(), 0);  // See Note [Launch order]
  chunks_.assign(set_.buckets.size(), 1);
  plan_history_.push_back(plan);
  adopt_grads_into_buckets();  // see Note [Bucket rebuild]
  for (Bucket& bucket : set_.buckets) renew_lazily(bucket);  // Note [Lazy bucket allocation]
  rebuild_pending_ = false;    // an explicit plan replaces the pending rebuild
  ready_order_.clear();
}

}  // namespace pyreducer
