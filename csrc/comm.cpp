#include "comm.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/record_function_ops.h>

#include "timeline.h"

#include <stdexcept>
#include <vector>

namespace pyreducer {

namespace {

// Launches a collective on `tensor` with `launch()` and attaches allreduce_sum_async's
// completion time and profiler range to its work. The range: on the CPU, `label` from launch to
// the work's future's completion (Gloo completes it when the collective is done). Off the CPU a
// range ended by the future would read as the collective's duration and be its launch's:
// ProcessGroupNCCL completes the future at enqueue (a CUDA-aware future). There the range is
// named `label` + ".launch" and ends when the launch returns: the host's enqueue, inside which the
// collective's kernel is launched, so the profiler links the range to that kernel on its CUDA
// timeline, whose span is the collective's device time (so is the device timeline's: Note
// [Device timeline] in device_timeline.h). Compiled, not run off the CPU: no GPU here.
template <typename Launch>
WorkPtr launch_timed(Launch&& launch, const at::Tensor& tensor, StampPtr done,
                     const std::function<std::string()>& label) {
  const bool completes_on_host = tensor.is_cpu();
  c10::intrusive_ptr<torch::autograd::profiler::PythonRecordFunction> range;
  if (label && at::hasCallbacks()) {
    range = torch::autograd::profiler::record_function_enter_new(
        completes_on_host ? label() : label() + ".launch");
  }
  WorkPtr work = launch();
  if (range && !completes_on_host) {
    range->record.end();
    range.reset();
  }
  if (done != nullptr || range) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = work->getFuture();
    } catch (const std::exception&) {
      return work;  // this backend has no futures: completion is known only from wait()
    }
    if (done != nullptr) {
      future->addCallback([done](c10::ivalue::Future& /*unused*/) { done->stamp(); });
    }
    if (range) torch::autograd::profiler::_call_end_callbacks_on_fut_new(range, future);
  }
  return work;
}

// The SUM all-reduce of `flat` on `group` (a ProcessGroup or a Backend), timed.
template <typename Group>
WorkPtr allreduce_sum_timed(const Group& group, at::Tensor& flat,
                            StampPtr done,
                            const std::function<std::string()>& label) {
  return launch_timed([&] {
    std::vector<at::Tensor> tensors{flat};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    return group->allreduce(tensors, options);
  }, flat, std::move(done), label);
}

// The SUM reduce-scatter of `flat` into `shard` on `group` (a ProcessGroup or a Backend), timed.
template <typename Group>
WorkPtr reduce_scatter_sum_timed(const Group& group, at::Tensor& shard, at::Tensor& flat,
                                 StampPtr done,
                                 const std::function<std::string()>& label) {
  if (flat.numel() != shard.numel() * group->getSize()) {
    throw std::invalid_argument("reduce-scatter: expected a buffer of " +
                                std::to_string(shard.numel() * group->getSize()) +
                                " elements (shard x world size), got " +
                                std::to_string(flat.numel()));
  }
  return launch_timed([&] {
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    // torch 2.13 deprecates ProcessGroup::_reduce_scatter_base for reduce_scatter_single, which
    // torch 2.11 and 2.12 do not have; every supported torch has this one (an alias in 2.13+).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return group->_reduce_scatter_base(shard, flat, options);
#pragma GCC diagnostic pop
  }, flat, std::move(done), label);
}

}  // namespace

WorkPtr allreduce_sum_async(const ProcessGroupPtr& group, at::Tensor& flat,
                            StampPtr done,
                            const std::function<std::string()>& label) {
  return allreduce_sum_timed(group, flat, std::move(done), label);
}

WorkPtr allreduce_sum_async(const BackendPtr& backend, at::Tensor& flat,
                            StampPtr done,
                            const std::function<std::string()>& label) {
  return allreduce_sum_timed(backend, flat, std::move(done), label);
}

WorkPtr reduce_scatter_sum_async(const ProcessGroupPtr& group, at::Tensor& shard,
                                 at::Tensor& flat, StampPtr done,
                                 const std::function<std::string()>& label) {
  return reduce_scatter_sum_timed(group, shard, flat, std::move(done), label);
}

WorkPtr reduce_scatter_sum_async(const BackendPtr& backend, at::Tensor& shard, at::Tensor& flat,
                                 StampPtr done,
                                 const std::function<std::string()>& label) {
  return reduce_scatter_sum_timed(backend, shard, flat, std::move(done), label);
}

void broadcast_int64s(const ProcessGroupPtr& group, std::vector<int64_t>& values, int64_t root,
                      c10::Device device) {
  const at::Tensor host = at::tensor(values, at::TensorOptions().dtype(at::kLong));
  std::vector<at::Tensor> tensors{host.to(device)};  // a copy only off the CPU
  c10d::BroadcastOptions options;
  options.rootRank = root;
  wait_or_throw(group->broadcast(tensors, options), group, "broadcast of the bucket order");
  const at::Tensor result = tensors.front().to(at::kCPU);  // blocking: the broadcast is done
  const int64_t* data = result.const_data_ptr<int64_t>();
  values.assign(data, data + result.numel());
}

std::vector<int64_t> all_gather_int64s(const ProcessGroupPtr& group,
                                       const std::vector<int64_t>& mine, c10::Device device,
                                       const std::string& what) {
  const auto n = static_cast<int64_t>(mine.size());
  at::Tensor table = at::zeros({group->getSize() * n}, at::TensorOptions().dtype(at::kLong));
  if (n > 0) {
    table.narrow(0, group->getRank() * n, n).copy_(at::tensor(mine, table.options()));
  }
  std::vector<at::Tensor> tensors{table.to(device)};  // a copy only off the CPU
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  wait_or_throw(group->allreduce(tensors, options), group, what);
  const at::Tensor result = tensors.front().to(at::kCPU);  // blocking: the all-reduce is done
  const int64_t* data = result.const_data_ptr<int64_t>();
  return {data, data + result.numel()};
}

void wait_or_throw(const WorkPtr& work, const ProcessGroupPtr& group, const std::string& what) {
  try {
    if (!work->wait()) {
      throw std::runtime_error("the work was aborted");
    }
  } catch (const std::exception& error) {
    throw CollectiveError("pyreducer: " + what + " failed on rank " +
                             std::to_string(group->getRank()) + " of " +
                             std::to_string(group->getSize()) +
                             " (a peer may have died or diverged): " + error.what());
  }
}

}  // namespace pyreducer
