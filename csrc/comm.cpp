#include "comm.h"

#include <stdexcept>
#include <vector>

namespace pyreducer {

WorkPtr allreduce_sum_async(const ProcessGroupPtr& group, at::Tensor& flat) {
  std::vector<at::Tensor> tensors{flat};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return group->allreduce(tensors, options);
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
