// The only code that launches collectives on a c10d::ProcessGroup and waits on c10d::Work.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "timeline.h"

namespace pyreducer {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;

// A collective that failed or timed out (wait_or_throw): a peer died, froze or diverged.
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Launches an asynchronous SUM all-reduce of `flat` on `group` and returns its work handle at
// once. Every rank must call it for the same buckets in the same order. Any thread.
// If `done` is given, it is stamped from the communication thread when the work's future
// completes; the callback keeps it alive (it may run after the caller has seen the work
// complete, even after the caller is gone), and the caller stamps it after its wait if the
// callback has not yet (Note [Completion stamps] in timeline.h). If a torch profiler is
// active, a range named `label` spans launch to completion on the CPU; off the CPU, where
// NCCL's work completes at enqueue, a range named `label` + ".launch" spans the launch alone
// (comm.cpp, launch_timed). `label` is only built then.
WorkPtr allreduce_sum_async(const ProcessGroupPtr& group, at::Tensor& flat,
                            StampPtr done = nullptr,
                            const std::function<std::string()>& label = {});

// The same on one backend of a group's ranks (a sparse gradient's, see Note [Sparse gradients
// beside Gloo's race] in reducer.h).
WorkPtr allreduce_sum_async(const BackendPtr& backend, at::Tensor& flat,
                            StampPtr done = nullptr,
                            const std::function<std::string()>& label = {});

// Launches an asynchronous SUM reduce-scatter: `shard` (n elements) receives elements
// [rank * n, (rank + 1) * n) of the sum of every rank's `flat` (n * world size elements;
// std::invalid_argument otherwise), on `group` or one `backend` of its ranks. Ordering, `done`
// and `label` as allreduce_sum_async. Any thread.
WorkPtr reduce_scatter_sum_async(const ProcessGroupPtr& group, at::Tensor& shard,
                                 at::Tensor& flat,
                                 StampPtr done = nullptr,
                                 const std::function<std::string()>& label = {});
WorkPtr reduce_scatter_sum_async(const BackendPtr& backend, at::Tensor& shard, at::Tensor& flat,
                                 StampPtr done = nullptr,
                                 const std::function<std::string()>& label = {});

// Overwrites `values` on every rank with rank `root`'s (same length on every rank). The values
// travel on `device`, the parameters' (an NCCL group broadcasts device tensors only), and are
// read back with a blocking copy: on NCCL, wait() only makes the current stream wait. Blocking;
// on Gloo (or NCCL with TORCH_NCCL_BLOCKING_WAIT=1) bounded by the process group's timeout, on
// NCCL otherwise by its watchdog (docs/pages/guides/gpus.md, "When a peer fails on NCCL"). Python
// thread.
void broadcast_int64s(const ProcessGroupPtr& group, std::vector<int64_t>& values, int64_t root,
                      c10::Device device);

// Every rank's `mine` (same length on every rank), rank r's at [r * mine.size(), ...): one SUM
// all-reduce of a world_size x n table in which each rank fills its own row, on `device`. Blocking
// and bounded as broadcast_int64s. Python or autograd thread.
std::vector<int64_t> all_gather_int64s(const ProcessGroupPtr& group,
                                       const std::vector<int64_t>& mine, c10::Device device,
                                       const std::string& what);

// Blocks until `work` completes. On Gloo (and NCCL with TORCH_NCCL_BLOCKING_WAIT=1) the wait is
// bounded by the process group's timeout, and on failure it throws CollectiveError whose
// message starts with `what` (e.g. "all-reduce of bucket 3") and names this rank. On NCCL
// otherwise wait() only makes the current stream wait and returns at once: a failed collective
// is the watchdog's to report (docs/pages/guides/gpus.md, "When a peer fails on NCCL").
void wait_or_throw(const WorkPtr& work, const ProcessGroupPtr& group, const std::string& what);

}  // namespace pyreducer
