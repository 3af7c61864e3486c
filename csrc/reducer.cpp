#include "reducer.h"

#include <sstream>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "bucketing.h"
#include "ops.h"

namespace pyreducer {

namespace {

// Post-hook on a parameter's AccumulateGrad node: runs after the gradient is in param.grad.
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(Reducer* reducer, size_t index) : reducer_(reducer), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    reducer_->mark_variable_ready(index_);
    return outputs;
  }

 private:
  Reducer* reducer_;
  size_t index_;
};

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> param_names,
                 const std::vector<std::vector<int64_t>>& initial_plan, ProcessGroupPtr group,
                 std::vector<int64_t> rebuild_caps_bytes)
    : params_(std::move(params)),
      param_names_(std::move(param_names)),
      group_(std::move(group)),
      rebuild_caps_bytes_(std::move(rebuild_caps_bytes)),
      ready_(params_.size(), 0) {
  if (param_names_.size() != params_.size()) {
    throw std::invalid_argument("Reducer: expected one name per parameter (" +
                                std::to_string(params_.size()) + "), got " +
                                std::to_string(param_names_.size()));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad()) {
      throw std::invalid_argument("Reducer: parameter " + param_names_[i] +
                                  " does not require grad");
    }
  }
  world_size_ = group_->getSize();
  grad_scale_ = 1.0 / static_cast<double>(world_size_);
  set_ = make_buckets(params_, param_names_, initial_plan);
  rebuild_pending_ = !rebuild_caps_bytes_.empty();
  ready_order_.reserve(params_.size());

  accumulators_.reserve(params_.size());
  hook_keys_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(this, i)));
    accumulators_.push_back(std::move(accumulator));
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

bool Reducer::armed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return armed_;
}

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

void Reducer::prepare_for_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finalize_queued_) {
    // The previous synced backward was interrupted (an exception inside backward) before its
    // end-of-backward callback ran.
    if (next_bucket_ > 0) {
      std::string message =
          "pyreducer: the previous backward on rank " + std::to_string(group_->getRank()) +
          " was interrupted after it had launched " + std::to_string(next_bucket_) + " of " +
          std::to_string(set_.buckets.size()) +
          " bucket all-reduces; the ranks may now disagree on which collectives ran, so "
          "training cannot continue safely. Fix the error raised in that backward.";
      reset_iteration();
      throw std::runtime_error(message);
    }
    reset_iteration();
  }
  armed_ = true;
}

bool Reducer::rebuild_buckets() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!rebuild_pending_ || !ready_order_complete_) return false;
  if (armed_ || finalize_queued_) {
    throw std::logic_error("pyreducer: rebuild_buckets called while a backward is pending");
  }
  broadcast_int64s(group_, ready_order_, /*root=*/0);
  std::vector<ParamSpec> specs(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    specs[i] = ParamSpec{params_[i].numel() * static_cast<int64_t>(params_[i].element_size()),
                         group_key(params_[i])};
  }
  std::vector<std::vector<int64_t>> plan;
  for (BucketSpec& spec : assign_buckets(specs, ready_order_, rebuild_caps_bytes_)) {
    plan.push_back(std::move(spec.param_indices));
  }
  set_ = make_buckets(params_, param_names_, plan);
  rebuild_pending_ = false;
  ready_order_.clear();
  return true;
}

void Reducer::check_gradient(size_t index, const at::Tensor& grad, const at::Tensor& slot) const {
  if (!grad.defined()) return;
  if (grad.layout() != c10::kStrided) {
    throw std::runtime_error("pyreducer: parameter " + param_names_[index] + " produced a " +
                             c10::str(grad.layout()) +
                             " gradient; only dense (strided) gradients are supported");
  }
  if (grad.scalar_type() != slot.scalar_type() || grad.device() != slot.device() ||
      !grad.sizes().equals(slot.sizes())) {
    std::ostringstream message;
    message << "pyreducer: parameter " << param_names_[index] << " expected a gradient of "
            << slot.scalar_type() << " on " << slot.device() << " with shape " << slot.sizes()
            << ", found " << grad.scalar_type() << " on " << grad.device() << " with shape "
            << grad.sizes();
    throw std::runtime_error(message.str());
  }
}

void Reducer::mark_variable_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!armed_) return;
  if (ready_[index]) {
    throw std::runtime_error(
        "pyreducer: parameter " + param_names_[index] + " on rank " +
        std::to_string(group_->getRank()) +
        " was marked ready twice in one backward: its AccumulateGrad hook fired more than "
        "once, which happens with reentrant activation checkpointing; this needs "
        "static_graph=True.");
  }
  const SlotLocation& location = set_.locations[index];
  Bucket& bucket = set_.buckets[location.bucket];
  at::Tensor& slot = bucket.views[location.slot];
  const at::Tensor& grad = params_[index].grad();
  check_gradient(index, grad, slot);  // before any state changes

  if (!finalize_queued_) {
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
    finalize_queued_ = true;
  }
  ready_[index] = 1;
  num_ready_ += 1;
  if (rebuild_pending_ && !ready_order_complete_) ready_order_.push_back(index);

  at::NoGradGuard no_grad;
  if (grad.defined()) {
    copy_scaled_into(slot, grad, grad_scale_);
  } else {
    slot.zero_();
  }
  bucket.pending -= 1;
  if (bucket.pending == 0 && location.bucket == next_bucket_) {
    launch_ready_buckets();
  }
}

void Reducer::launch_ready_buckets() {
  while (next_bucket_ < set_.buckets.size() && set_.buckets[next_bucket_].pending == 0) {
    Bucket& bucket = set_.buckets[next_bucket_];
    bucket.work = allreduce_sum_async(group_, bucket.flat);
    next_bucket_ += 1;
  }
}

std::string Reducer::describe_unready(size_t max_names) const {
  std::string names;
  size_t count = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    if (count < max_names) names += (count ? ", " : "") + param_names_[i];
    count += 1;
  }
  if (count > max_names) names += ", ... (" + std::to_string(count - max_names) + " more)";
  return std::to_string(count) + " parameter(s) received no gradient: " + names;
}

void Reducer::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (next_bucket_ < set_.buckets.size()) {
    std::string message =
        "pyreducer: backward on rank " + std::to_string(group_->getRank()) +
        " finished before every gradient was reduced: " + describe_unready(20) +
        ". The gradients would be left un-averaged. Make every parameter take part in the "
        "loss, or exclude it with "
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names) "
        "before wrapping, or set requires_grad=False on it.";
    reset_iteration();
    throw std::runtime_error(message);
  }
  try {
    for (size_t b = 0; b < set_.buckets.size(); ++b) {
      wait_or_throw(set_.buckets[b].work, group_, "all-reduce of bucket " + std::to_string(b));
    }
  } catch (...) {
    reset_iteration();
    throw;
  }
  at::NoGradGuard no_grad;
  for (Bucket& bucket : set_.buckets) {
    for (size_t k = 0; k < bucket.param_indices.size(); ++k) {
      at::Tensor& param = params_[bucket.param_indices[k]];
      copy_out_of_slot(param.mutable_grad(), bucket.views[k], param);
    }
  }
  if (rebuild_pending_) ready_order_complete_ = true;
  reset_iteration();
}

void Reducer::reset_iteration() {
  armed_ = false;
  finalize_queued_ = false;
  next_bucket_ = 0;
  std::fill(ready_.begin(), ready_.end(), 0);
  num_ready_ = 0;
  if (!ready_order_complete_) ready_order_.clear();  // only a finished backward's order counts
  for (Bucket& bucket : set_.buckets) {
    bucket.pending = bucket.param_indices.size();
    bucket.work.reset();
  }
}

}  // namespace pyreducer
