#include "reducer.h"

#include <sstream>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

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

// A slot shaped like `param` inside `flat` at `offset` elements. Dense parameters get their own
// strides (so gradients keep the parameter's memory format, as torch DDP's bucket views do).
at::Tensor make_view(const at::Tensor& flat, const at::Tensor& param, int64_t offset) {
  if (param.is_non_overlapping_and_dense()) {
    return flat.as_strided(param.sizes(), param.strides(), offset);
  }
  return flat.narrow(0, offset, param.numel()).view(param.sizes());
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> param_names,
                 const std::vector<std::vector<int64_t>>& bucket_param_indices,
                 ProcessGroupPtr group)
    : params_(std::move(params)),
      param_names_(std::move(param_names)),
      locations_(params_.size()),
      group_(std::move(group)),
      ready_(params_.size(), 0) {
  if (param_names_.size() != params_.size()) {
    throw std::invalid_argument("Reducer: expected one name per parameter (" +
                                std::to_string(params_.size()) + "), got " +
                                std::to_string(param_names_.size()));
  }
  world_size_ = group_->getSize();
  grad_scale_ = 1.0 / static_cast<double>(world_size_);

  std::vector<uint8_t> placed(params_.size(), 0);
  buckets_.reserve(bucket_param_indices.size());
  for (size_t b = 0; b < bucket_param_indices.size(); ++b) {
    Bucket bucket;
    bucket.param_indices = bucket_param_indices[b];
    if (bucket.param_indices.empty()) {
      throw std::invalid_argument("Reducer: bucket " + std::to_string(b) + " is empty");
    }
    const at::Tensor& first = params_.at(bucket.param_indices.front());
    int64_t numel = 0;
    for (size_t k = 0; k < bucket.param_indices.size(); ++k) {
      const int64_t i = bucket.param_indices[k];
      if (i < 0 || i >= static_cast<int64_t>(params_.size()) || placed[i]) {
        throw std::invalid_argument("Reducer: bucket " + std::to_string(b) +
                                    " lists parameter index " + std::to_string(i) +
                                    ", which is out of range or already in a bucket");
      }
      const at::Tensor& p = params_[i];
      if (p.scalar_type() != first.scalar_type() || p.device() != first.device()) {
        throw std::invalid_argument(
            "Reducer: bucket " + std::to_string(b) + " mixes " + param_names_[i] + " (" +
            std::string(c10::toString(p.scalar_type())) + ", " + p.device().str() + ") with " +
            param_names_[bucket.param_indices.front()] + " (" +
            std::string(c10::toString(first.scalar_type())) + ", " + first.device().str() + ")");
      }
      placed[i] = 1;
      locations_[i] = Location{b, k};
      numel += p.numel();
    }
    bucket.flat = at::zeros({numel}, first.options().requires_grad(false));
    bucket.size_bytes = numel * static_cast<int64_t>(first.element_size());
    int64_t offset = 0;
    for (int64_t i : bucket.param_indices) {
      bucket.views.push_back(make_view(bucket.flat, params_[i], offset));
      offset += params_[i].numel();
    }
    bucket.pending = bucket.param_indices.size();
    buckets_.push_back(std::move(bucket));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!placed[i]) {
      throw std::invalid_argument("Reducer: parameter " + param_names_[i] + " is in no bucket");
    }
  }

  accumulators_.reserve(params_.size());
  hook_keys_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad()) {
      throw std::invalid_argument("Reducer: parameter " + param_names_[i] +
                                  " does not require grad");
    }
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

void Reducer::prepare_for_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (num_ready_ > 0 && !finalize_queued_) {
    // Unreachable in a well-formed run: finalize is queued by the first hook.
    throw std::logic_error("pyreducer: internal error: gradients were marked ready but no "
                           "end-of-backward callback was queued");
  }
  if (finalize_queued_) {
    // The previous synced backward was interrupted (an exception inside backward) before its
    // end-of-backward callback ran.
    if (next_bucket_ > 0) {
      std::string message =
          "pyreducer: the previous backward on rank " + std::to_string(group_->getRank()) +
          " was interrupted after it had launched " + std::to_string(next_bucket_) + " of " +
          std::to_string(buckets_.size()) +
          " bucket all-reduces; the ranks may now disagree on which collectives ran, so "
          "training cannot continue safely. Fix the error raised in that backward.";
      reset_iteration();
      throw std::runtime_error(message);
    }
    reset_iteration();
  }
  armed_ = true;
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
  at::NoGradGuard no_grad;
  if (ready_[index]) {
    throw std::runtime_error(
        "pyreducer: parameter " + param_names_[index] + " on rank " +
        std::to_string(group_->getRank()) +
        " was marked ready twice in one backward. Its AccumulateGrad hook fired more than once, "
        "which happens with reentrant activation checkpointing or a parameter used in several "
        "reentrant backward passes; this needs static_graph=True.");
  }
  if (!finalize_queued_) {
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
    finalize_queued_ = true;
  }
  ready_[index] = 1;
  num_ready_ += 1;

  const Location& location = locations_[index];
  Bucket& bucket = buckets_[location.bucket];
  at::Tensor& slot = bucket.views[location.slot];
  const at::Tensor& grad = params_[index].grad();
  check_gradient(index, grad, slot);
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
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& bucket = buckets_[next_bucket_];
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
  if (next_bucket_ < buckets_.size()) {
    std::string message =
        "pyreducer: backward on rank " + std::to_string(group_->getRank()) +
        " finished before every gradient was reduced: " + describe_unready(20) +
        ". Gradients of the other buckets would be left un-averaged. Either every parameter "
        "must take part in the loss, or pass find_unused_parameters=True (parameters outside "
        "the graph are then reduced as zeros), or exclude them with "
        "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model.";
    reset_iteration();
    throw std::runtime_error(message);
  }
  try {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      wait_or_throw(buckets_[b].work, group_, "all-reduce of bucket " + std::to_string(b));
    }
  } catch (...) {
    reset_iteration();
    throw;
  }
  at::NoGradGuard no_grad;
  for (Bucket& bucket : buckets_) {
    for (size_t k = 0; k < bucket.param_indices.size(); ++k) {
      at::Tensor& param = params_[bucket.param_indices[k]];
      copy_out_of_slot(param.mutable_grad(), bucket.views[k], param);
    }
  }
  reset_iteration();
}

void Reducer::reset_iteration() {
  armed_ = false;
  finalize_queued_ = false;
  next_bucket_ = 0;
  std::fill(ready_.begin(), ready_.end(), 0);
  num_ready_ = 0;
  for (Bucket& bucket : buckets_) {
    bucket.pending = bucket.param_indices.size();
    bucket.work.reset();
  }
}

}  // namespace pyreducer
