#include "reducer.h"

#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include "ops.h"

namespace pyreducer {

namespace {

// A weak reference to a Reducer that can travel in an autograd context's saved data.
struct ReducerRef : torch::CustomClassHolder {
  explicit ReducerRef(std::weak_ptr<Reducer> r) : reducer(std::move(r)) {}
  std::weak_ptr<Reducer> reducer;
};

// Identity on the forward's outputs; its backward is the first node of the outer backward.
// See Note [Reducer iteration]. It holds its Reducer weakly: a graph (and this node) can
// outlive the wrapper that built it, and then does nothing. Its outputs are detached aliases of
// its inputs (same storage, same version counter), not the inputs themselves: autograd would make
// those views of a multi-output function, which refuse in-place updates (`loss *= scale`, as the
// HF Trainer does), where torch DDP's outputs accept them.
struct Sink : public torch::autograd::Function<Sink> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList outputs,
                                                std::weak_ptr<Reducer> reducer) {
    ctx->set_materialize_grads(false);  // unused outputs keep undefined gradients
    ctx->saved_data["reducer"] =
        c10::IValue::make_capsule(c10::make_intrusive<ReducerRef>(std::move(reducer)));
    torch::autograd::variable_list aliases;
    aliases.reserve(outputs.size());
    for (const at::Tensor& output : outputs) aliases.push_back(output.detach());
    return aliases;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto ref = c10::static_intrusive_pointer_cast<ReducerRef>(
        ctx->saved_data["reducer"].toCapsule());
    if (std::shared_ptr<Reducer> reducer = ref->reducer.lock()) reducer->on_backward_start();
    grads.emplace_back();  // no gradient for the reducer argument
    return grads;
  }
};

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> param_names,
                 const std::vector<std::vector<int64_t>>& initial_plan, ProcessGroupPtr group,
                 ReducerOptions options)
    : params_(std::move(params)),
      param_names_(std::move(param_names)),
      group_(std::move(group)),
      options_(std::move(options)),
      ready_(params_.size(), 0),
      locally_used_(params_.size(), 0),
      globally_unused_(params_.size(), 0),
      hook_counts_(params_.size(), 0),
      countdown_(params_.size(), 0),
      is_unused_(params_.size(), 0),
      timeline_(options_.timeline_iterations, params_.size()) {
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
  if (options_.rebuild_buckets && options_.rebuild_caps_bytes.empty()) {
    throw std::invalid_argument("Reducer: rebuild_buckets needs bucket caps for the rebuild, "
                                "got an empty rebuild_caps_bytes");
  }
  world_size_ = group_->getSize();
  divisor_ = world_size_;
  grad_scale_ = 1.0 / static_cast<double>(world_size_);
  sparse_.assign(params_.size(), 0);
  for (int64_t i : options_.sparse_params) {
    if (i < 0 || i >= static_cast<int64_t>(params_.size())) {
      throw std::invalid_argument("Reducer: sparse parameter index " + std::to_string(i) +
                                  " is out of range (" + std::to_string(params_.size()) +
                                  " parameters)");
    }
    sparse_[i] = 1;
  }
  install_plan(initial_plan);
  rebuild_pending_ = options_.rebuild_buckets;
  bool one_device = !params_.empty();
  for (const at::Tensor& p : params_) one_device = one_device && p.device() == params_[0].device();
  if (one_device) {
    device_timeline_ = make_device_timeline(params_[0].device(), options_.timeline_iterations,
                                            params_.size());  // null on CPU
  }
  ready_order_.reserve(params_.size());
  if (!params_.empty()) {
    used_map_ = at::zeros({static_cast<int64_t>(params_.size())},
                          at::TensorOptions().dtype(at::kInt).device(params_[0].device()));
  }
  // The hooks call into this Reducer: ~Reducer removes them before the Reducer is gone.
  hooks_ = std::make_unique<GradHooks>(params_, [this](size_t i) { autograd_hook(i); });
}

std::shared_ptr<Reducer> Reducer::create(std::vector<at::Tensor> params,
                                         std::vector<std::string> param_names,
                                         const std::vector<std::vector<int64_t>>& initial_plan,
                                         ProcessGroupPtr group, ReducerOptions options) {
  // Not make_shared: the constructor is private, so every Reducer is owned by a shared_ptr.
  return std::shared_ptr<Reducer>(new Reducer(std::move(params), std::move(param_names),
                                              initial_plan, std::move(group), std::move(options)));
}

Reducer::~Reducer() { hooks_.reset(); }

void Reducer::set_failure_context(std::function<std::string(const std::string&)> context) {
  std::lock_guard<std::mutex> lock(mutex_);
  failure_context_ = std::move(context);
}

void Reducer::fail(const std::string& message) {
  reset_iteration();
  last_error_ = message;
  throw std::runtime_error(message);
}

void Reducer::set_unused(std::vector<size_t> unused) {
  std::fill(is_unused_.begin(), is_unused_.end(), 0);
  for (size_t i : unused) is_unused_[i] = 1;
  unused_ = std::move(unused);
}

bool Reducer::all_unused(const Bucket& bucket) const {
  return std::all_of(bucket.param_indices.begin(), bucket.param_indices.end(),
                     [&](int64_t i) { return is_unused_[i] != 0; });
}

std::vector<at::Tensor> Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::unique_lock<std::mutex> lock(mutex_);
  complete_all_locked();  // See Note [Deferred completion]
  if (finalize_queued_ || backward_started_ || num_ready_ > 0) {
    // The previous synced backward was interrupted (an exception inside backward) before its
    // end-of-backward callback ran.
    if (next_launch_ > 0) {
      fail("pyreducer: the previous backward on rank " + std::to_string(group_->getRank()) +
           " was interrupted after it had launched " + std::to_string(next_launch_) + " of " +
           std::to_string(launch_order_.size()) +
           " bucket all-reduces; the ranks may now disagree on which collectives ran, so "
           "training cannot continue safely. Fix the error raised in that backward.");
    }
    reset_iteration();
  }
  armed_ = true;
  finalized_since_forward_ = false;
  num_iterations_ += 1;
  divisor_ = next_divisor_ > 0 ? next_divisor_ : world_size_;
  next_divisor_ = 0;
  grad_scale_ = comm_hook_ ? 1.0 : 1.0 / static_cast<double>(divisor_);
  stats_.iteration = num_iterations_;
  stats_.backward_start_ns = Timeline::now_ns();
  stats_.comm_start_ns = stats_.backward_end_ns = stats_.comm_end_ns = 0;
  stats_.buckets_reduced = 0;
  stats_.ready_order.clear();
  if (dynamic_find_unused()) {
    const std::vector<uint8_t> reached = reachable(outputs, hooks_->nodes());
    std::vector<size_t> unused;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!reached[i]) unused.push_back(i);
    }
    set_unused(std::move(unused));
  }
  if (static_after_first_iteration()) countdown_ = hook_counts_;
  lock.unlock();

  std::vector<at::Tensor> with_grad;
  std::vector<size_t> positions;
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (outputs[k].defined() && outputs[k].requires_grad()) {
      with_grad.push_back(outputs[k]);
      positions.push_back(k);
    }
  }
  std::vector<at::Tensor> result = outputs;
  if (!with_grad.empty()) {
    auto sunk = Sink::apply(at::TensorList(with_grad), weak_from_this());
    for (size_t k = 0; k < positions.size(); ++k) result[positions[k]] = sunk[k];
  }
  return result;
}

void Reducer::on_backward_start() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Not one that accumulates into no parameter (a gradient penalty's autograd.grad): reducer.h
  if (armed_ && backward_accumulates_any(hooks_->nodes())) begin_backward();
}

void Reducer::begin_backward() {
  if (backward_started_) return;
  backward_started_ = true;
  record_ = timeline_.begin(num_iterations_, static_cast<int64_t>(plan_history_.size()) - 1,
                            set_.buckets.size(), Timeline::now_ns());
  if (DeviceTimeline* device = device_recording()) device->begin(record_->slot);
  if (!finalize_queued_) {
    torch::autograd::Engine::get_default_engine().queue_callback(
        [reducer = weak_from_this()] {
          if (std::shared_ptr<Reducer> self = reducer.lock()) self->finalize_backward();
        });
    finalize_queued_ = true;
  }
  if (dynamic_find_unused() || static_after_first_iteration()) {
    // As torch DDP: ready, but not part of the recorded order (a static graph's rebuild appends
    // them after the parameters that got gradients, in index order; see rebuild_buckets).
    const size_t recorded = ready_order_.size();
    for (size_t index : unused_) mark_ready(index);
    ready_order_.resize(recorded);
  }
}

void Reducer::autograd_hook(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  noting_errors([&] { on_gradient(index); });
}

void Reducer::on_gradient(size_t index) {
  if (!armed_ && finalized_since_forward_) {
    throw std::runtime_error(
        "pyreducer: parameter " + param_names_[index] + " on rank " +
        std::to_string(group_->getRank()) +
        " received a gradient from a backward that no forward of the wrapper preceded (a "
        "second backward through one forward, or one through model.module or a submodule "
        "called directly): the last forward's gradients were reduced already, and this one "
        "would stay local (un-averaged). Run each forward through the wrapper, or use "
        "no_sync() for deliberate local accumulation.");
  }
  if (num_awaiting_ > 0) {  // See Note [Deferred completion]
    throw std::runtime_error(
        "pyreducer: parameter " + param_names_[index] + " on rank " +
        std::to_string(group_->getRank()) + " received a gradient while the previous step's "
        "reductions were still pending (" + std::to_string(num_awaiting_) + " bucket(s)): with "
        "an overlapped optimizer, run each forward through the wrapper (its forward completes "
        "them), or call model.synchronize() first.");
  }
  if ((dynamic_find_unused() || static_first_iteration()) &&
      params_[index].grad().defined()) {
    locally_used_[index] = 1;  // also under no_sync: see Note [Unused parameters]
  }
  if (!armed_) return;
  begin_backward();
  if (static_first_iteration()) {
    hook_counts_[index] += 1;  // reduced all at once in finalize_backward
    return;
  }
  stats_.ready_order.push_back(static_cast<int64_t>(index));
  if (static_after_first_iteration()) {
    if (hook_counts_[index] == 0 || countdown_[index] == 0) {
      // torch DDP's words first (its static-graph test matches on them), then pyreducer's.
      fail("Your training graph has changed in this iteration, e.g., one parameter is unused in "
           "first iteration, but then got used in the second iteration. this is not compatible "
           "with static_graph set to True. (pyreducer: parameter " + param_names_[index] +
           " on rank " + std::to_string(group_->getRank()) + " got more gradients this "
           "iteration than in the first one, " + std::to_string(hook_counts_[index]) + ".)");
    }
    if (--countdown_[index] > 0) return;
  }
  mark_ready(index);
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
    throw std::runtime_error(c10::str(
        "pyreducer: parameter ", param_names_[index], " expected a gradient of ",
        slot.scalar_type(), " on ", slot.device(), " with shape ", slot.sizes(), ", found ",
        grad.scalar_type(), " on ", grad.device(), " with shape ", grad.sizes()));
  }
}

void Reducer::mark_ready(size_t index) {
  if (ready_[index]) {
    // torch DDP's words first (its tests match on the start), then pyreducer's.
    fail("Expected to mark a variable ready only once. Parameter at index " +
         std::to_string(index) + " with name " + param_names_[index] + " has been marked as "
         "ready twice. This means that multiple autograd engine hooks have fired for this "
         "particular parameter during this iteration. (pyreducer: rank " +
         std::to_string(group_->getRank()) + "; reentrant activation checkpointing does this: "
         "pass static_graph=True; or the parameter was found unused and then got a gradient "
         "anyway.)");
  }
  const SlotLocation& location = set_.locations[index];
  Bucket& bucket = set_.buckets[location.bucket];
  if (bucket.sparse) {
    mark_sparse_ready(index, bucket);
  } else {
    if (bucket.released) acquire_buffer(bucket);  // See Note [Released bucket buffers]
    copy_into_slot(index, bucket.views[location.slot]);
  }
  note_copy_stream(bucket);  // See Note [Streams of a bucket]
  if (DeviceTimeline* device = device_recording()) device->grad_ready(record_->slot, index);
  bucket.pending -= 1;
  if (bucket.pending == 0) {
    if (options_.batched_grad_copy) copy_bucket_in(location.bucket);
    if (record_) record_->bucket_ready_ns[location.bucket] = Timeline::now_ns();
    if (DeviceTimeline* device = device_recording()) {
      device->bucket_ready(record_->slot, location.bucket);
    }
    if (next_launch_ < launch_order_.size() &&
        static_cast<int64_t>(location.bucket) == launch_order_[next_launch_]) {
      launch_ready_buckets();
    }
  }
}

void Reducer::note_ready(size_t index) {
  ready_[index] = 1;
  num_ready_ += 1;
  if (record_) record_->grad_ready_ns[index] = Timeline::now_ns();
  if (rebuild_pending_ && !ready_order_complete_ && !static_first_iteration()) {
    ready_order_.push_back(static_cast<int64_t>(index));
  }
}

void Reducer::copy_into_slot(size_t index, at::Tensor& slot) {
  at::Tensor& grad = params_[index].mutable_grad();
  check_gradient(index, grad, slot);
  note_ready(index);
  if (options_.batched_grad_copy) return;  // the whole bucket at once, when it is full
  at::NoGradGuard no_grad;
  if (!grad.defined()) {
    slot.zero_();
  } else if (grad.is_alias_of(slot)) {
    if (!comm_hook_) slot.div_(divisor_);  // bucket view, accumulated in place: as DDP
  } else {
    copy_scaled_into(slot, grad, grad_scale_);
    if (options_.gradient_as_bucket_view) {
      grad = slot;
    } else if (sharded_ && !is_unused_[index]) {
      let_go_of_gradient(grad);  // in the bucket now, not read again (Note [Sharded gradients])
    }
  }
}

void Reducer::mark_sparse_ready(size_t index, Bucket& bucket) {
  at::Tensor& grad = params_[index].mutable_grad();
  if (!grad.defined() || grad.layout() != c10::kSparse) {
    fail(std::string(grad.defined() ? "Expected variable to have sparse gradient."
                                    : "Expected sparse gradient to be defined.") +
         " (pyreducer: parameter " + param_names_[index] + " on rank " +
         std::to_string(group_->getRank()) + " belongs to an nn.Embedding/EmbeddingBag with "
         "sparse=True, so every synced backward must give it a sparse gradient; found " +
         (grad.defined() ? "a " + c10::str(grad.layout()) + " one" : "none") + ")");
  }
  note_ready(index);
  at::NoGradGuard no_grad;
  if (!comm_hook_) grad.div_(divisor_);  // in place, as torch DDP; summed by the all-reduce
  bucket.flat = grad;                    // the same tensor: the result is copied back into it
}

void Reducer::finalize_backward() {
  std::function<void()> deferred;
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    noting_errors([&] { finalize(); });
    if (num_awaiting_ > 0) deferred = on_deferred_;
  } catch (const CollectiveError& error) {
    // Outside the lock: the context takes the GIL and waits for the other ranks' reports, and
    // a Python thread holding the GIL may be waiting for the lock.
    std::function<std::string(const std::string&)> context;
    std::string phase;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      context = failure_context_;
      phase = failure_phase_;
    }
    if (!context) throw;
    throw CollectiveError(std::string(error.what()) + context(phase));
  }
  if (deferred) deferred();  // outside the lock: it may call back into the Reducer
}

void Reducer::finalize() {
  std::string finite_error;
  stats_.backward_end_ns = Timeline::now_ns();
  if (record_) record_->backward_end_ns = stats_.backward_end_ns;
  if (DeviceTimeline* device = device_recording()) device->backward_end(record_->slot);
  if (static_first_iteration()) {
    // See Note [Unused parameters]: reduce everything now, in parameter order.
    std::vector<size_t> unused;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (hook_counts_[i] == 0) unused.push_back(i);
    }
    set_unused(std::move(unused));
    for (size_t i = 0; i < params_.size(); ++i) mark_ready(i);
    launch_used_map_allreduce();
  }
  if (next_launch_ < launch_order_.size()) {
    fail(unready_error());
  }
  if (deferred_) {
    defer_reductions();  // See Note [Deferred completion]
  } else {
    try {
      wait_and_copy_out();
      finite_error = check_finite_reduced();  // See Note [Finite check]; raised at the end
    } catch (const CollectiveError& error) {
      reset_iteration();
      if (comm_hook_) comm_hook_->backward_ended();
      failure_phase_ = "backward of iteration " + std::to_string(stats_.iteration);
      throw;  // finalize_backward adds the failure context, outside the lock
    } catch (...) {
      reset_iteration();
      if (comm_hook_) comm_hook_->backward_ended();
      throw;
    }
    if (comm_hook_) comm_hook_->backward_ended();
  }
  if (dynamic_find_unused()) std::fill(locally_used_.begin(), locally_used_.end(), 0);
  if (rebuild_pending_ && !ready_order_complete_ && !static_first_iteration()) {
    ready_order_complete_ = true;
  }
  finalized_since_forward_ = true;
  num_backwards_ += 1;
  stats_.comm_end_ns = deferred_ ? 0 : Timeline::now_ns();  // deferred: at the last completion
  stats_.unused.assign(unused_.begin(), unused_.end());
  last_stats_ = stats_;
  if (record_) {
    record_->finalize_end_ns = Timeline::now_ns();
    record_->complete = true;
    if (device_timeline_) device_timeline_->end(record_->slot);  // See Note [Device timeline]
  }
  reset_iteration(/*keep_reductions=*/deferred_);
  if (!deferred_) {  // written back: see Note [Lazy bucket allocation]
    for (Bucket& bucket : set_.buckets) renew_lazily(bucket);
  }
  // A failed finite check ends a complete iteration (gradients written back, unused-parameter
  // state reset), so that training can go on after the error, on every rank alike.
  if (!finite_error.empty()) throw std::runtime_error(finite_error);
}

void Reducer::reset_iteration(bool keep_reductions) {
  record_ = nullptr;
  armed_ = false;
  finalize_queued_ = false;
  backward_started_ = false;
  next_launch_ = 0;
  std::fill(ready_.begin(), ready_.end(), 0);
  num_ready_ = 0;
  used_map_work_.reset();
  if (!ready_order_complete_) ready_order_.clear();  // only a finished backward's order counts
  for (Bucket& bucket : set_.buckets) {
    bucket.pending = bucket.param_indices.size();
    bucket.copy_streams.clear();
    bucket.chunks_launched = 0;
    bucket.local_nonfinite = at::Tensor();  // See Note [Finite check]: never carried over
    bucket.reduced_nonfinite = at::Tensor();
    if (keep_reductions) continue;  // completed later, bucket by bucket (skipped: re-decided
                                    // at the next launch, see launch_ready_buckets)
    bucket.works.clear();
    bucket.future.reset();
    bucket.ring_job.reset();
    bucket.skipped = false;
    if (bucket.sparse) bucket.flat = at::Tensor();  // the gradient stays the parameter's alone
  }
}

}  // namespace pyreducer
