#include "comm.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <vector>

namespace pyreducer {

WorkPtr allreduce_sum_async(const ProcessGroupPtr& group, at::Tensor& flat) {
  std::vector<at::Tensor> tensors{flat};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return group->allreduce(tensors, options);
}

void broadcast_int64s(const ProcessGroupPtr& group, std::vector<int64_t>& values, int64_t root) {
  at::Tensor tensor = at::tensor(values, at::TensorOptions().dtype(at::kLong));
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  wait_or_throw(group->broadcast(tensors, options), group, "broadcast of the bucket order");
  const int64_t* data = tensor.data_ptr<int64_t>();
  values.assign(data, data + tensor.numel());
}

void wait_or_throw(const WorkPtr& work, const ProcessGroupPtr& group, const std::string& what) {
  try {
    if (!work->wait()) {
      throw std::runtime_error("the work was aborted");
    }
  } catch (const std::exception& error) {
    throw std::runtime_error("pyreducer: " + what + " failed on rank " +
                             std::to_string(group->getRank()) + " of " +
                             std::to_string(group->getSize()) +
                             " (a peer may have died or diverged): " + error.what());
  }
}

}  // namespace pyreducer
