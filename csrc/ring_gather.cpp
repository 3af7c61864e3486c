// Planned all-gathers: a bucket's pieces in the order the next forward reads them (Note [Gathers
// in read order] in pyreducer/sharded/gather_plan.py), each waited for on its own.
//
// The worker thread sends, a receiver thread receives. Every receive is posted first (piece p
// under tag base + p), then the receiver thread waits for them in the order rank + 1 sends them
// (Gloo delivers one pair's messages in the order they were posted), marking each piece here as
// it lands; the worker posts this rank's sends in the plan's order, each once its piece may go:
// received, or its own and marked ready by the caller (who steps the shard segment by segment
// meanwhile). Two threads, so that neither a slow receive holds back an own piece just marked
// ready, nor an own piece not yet stepped holds back the receives (with one thread, two ranks
// each waiting to receive before sending would wait for each other).
#include <algorithm>
#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "ring.h"

namespace pyreducer {

bool RingJob::arrived(int64_t begin, int64_t end) const {
  const Pieces& pieces = *pieces_;
  // the first piece that ends after `begin` (pieces are disjoint: sorted by begin, by end too)
  auto it = std::partition_point(pieces.by_begin.begin(), pieces.by_begin.end(),
                                 [&](int64_t p) { return pieces.ends[p] <= begin; });
  for (; it != pieces.by_begin.end() && pieces.begins[*it] < end; ++it) {
    if (!pieces.here[*it]) return false;
  }
  return true;
}

void RingJob::wait_range(int64_t begin, int64_t end) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (pieces_) {
      cv_.wait(lock, [&] { return done_ || arrived(begin, end); });
      if (!done_ || !error_) return;
    }
  }
  wait();  // (unplanned, or failed: rethrows)
}

void RingJob::mark_ready(int64_t begin, int64_t end) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pieces_) return;
    Pieces& pieces = *pieces_;
    for (size_t p = 0; p < pieces.begins.size(); ++p) {
      if (pieces.own[p] && pieces.begins[p] >= begin && pieces.ends[p] <= end) {
        pieces.sendable[p] = 1;
      }
    }
  }
  cv_.notify_all();
}

void RingJob::cancel(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pieces_ || !pieces_->cancelled.empty()) return;
    pieces_->cancelled = why.empty() ? "cancelled" : why;
  }
  cv_.notify_all();
}

void RingJob::wait_sendable(int64_t p, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  Pieces& pieces = *pieces_;
  const bool in_time = cv_.wait_for(lock, timeout, [&] {
    return pieces.sendable[p] || !pieces.cancelled.empty() || pieces.receive_error;
  });
  if (pieces.receive_error) std::rethrow_exception(pieces.receive_error);
  if (!pieces.cancelled.empty()) {
    throw std::runtime_error("this rank stopped before its elements were ready (" +
                             pieces.cancelled + ")");
  }
  if (!in_time) {
    throw std::runtime_error("this rank's elements [" + std::to_string(pieces.begins[p]) + ", " +
                             std::to_string(pieces.ends[p]) + ") were not marked ready within " +
                             std::to_string(timeout.count()) + " ms");
  }
}

void RingJob::set_arrived(int64_t p) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pieces_->here[p] = 1;
    pieces_->sendable[p] = 1;
  }
  cv_.notify_all();
}

void RingJob::set_receive_error(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pieces_->receive_error = std::move(error);
  }
  cv_.notify_all();
}

namespace {

void check_plan(const GatherPlan& plan, int64_t numel, int64_t rank, int64_t world) {
  auto fail = [](const std::string& message) {
    throw std::invalid_argument("planned ring all-gather: " + message);
  };
  const int64_t count = static_cast<int64_t>(plan.begins.size());
  if (plan.ends.size() != plan.begins.size()) fail("as many ends as begins expected");
  if (count > RingCollectives::kTagsPerJob) {
    fail("at most " + std::to_string(RingCollectives::kTagsPerJob) + " pieces, got " +
         std::to_string(count));
  }
  const int64_t n = numel / world;
  for (int64_t p = 0; p < count; ++p) {
    const int64_t begin = plan.begins[p], end = plan.ends[p];
    if (begin < 0 || end > numel || begin >= end || begin / n != (end - 1) / n) {
      fail("piece " + std::to_string(p) + " [" + std::to_string(begin) + ", " +
           std::to_string(end) + ") is not a non-empty range inside one chunk of " +
           std::to_string(n) + " elements of a buffer of " + std::to_string(numel));
    }
  }
  auto check_list = [&](const std::vector<int64_t>& list, int64_t excluded, const char* name) {
    std::vector<uint8_t> seen(count, 0);
    for (int64_t p : list) {
      if (p < 0 || p >= count || seen[p] || plan.begins[p] / n == excluded) {
        fail(std::string(name) + " lists piece " + std::to_string(p) + ": expected each piece " +
             "of " + std::to_string(count) + " at most once, none of rank " +
             std::to_string(excluded) + "'s chunk");
      }
      seen[p] = 1;
    }
  };
  check_list(plan.sends, (rank + world - 1) % world, "sends");
  check_list(plan.receives, rank, "receives");
}

}  // namespace

std::shared_ptr<RingJob> RingCollectives::all_gather(at::Tensor flat, GatherPlan plan,
                                                     std::string what) {
  if (flat.numel() % world_ != 0 || !flat.is_contiguous() || flat.dim() != 1) {
    throw std::invalid_argument("planned ring all-gather: expected a contiguous 1-D buffer of "
                                "a multiple of " + std::to_string(world_) + " elements, got " +
                                std::to_string(flat.numel()));
  }
  check_plan(plan, flat.numel(), rank_, world_);
  auto pieces = std::make_unique<RingJob::Pieces>();
  const int64_t count = static_cast<int64_t>(plan.begins.size());
  const int64_t n = flat.numel() / world_;
  pieces->begins = plan.begins;
  pieces->ends = plan.ends;
  pieces->by_begin.resize(count);
  for (int64_t p = 0; p < count; ++p) pieces->by_begin[p] = p;
  std::sort(pieces->by_begin.begin(), pieces->by_begin.end(),
            [&](int64_t a, int64_t b) { return plan.begins[a] < plan.begins[b]; });
  pieces->own.resize(count);
  pieces->here.resize(count);
  pieces->sendable.assign(count, 0);
  for (int64_t p = 0; p < count; ++p) {
    pieces->own[p] = pieces->here[p] = plan.begins[p] / n == rank_ ? 1 : 0;
  }
  auto job = std::make_shared<RingJob>();
  job->pieces_ = std::move(pieces);
  RingJob* raw = job.get();  // (alive while queued and run: the queue and run() hold it)
  return enqueue(job, [this, flat, plan = std::move(plan), raw] {
    run_planned_all_gather(flat, plan, *raw);
  }, std::move(what));
}

void RingCollectives::run_planned_all_gather(const at::Tensor& flat, const GatherPlan& plan,
                                             RingJob& job) {
  const int base = next_job_tag();
  if (world_ == 1) return;
  const int to = static_cast<int>((rank_ + world_ - 1) % world_);  // Gloo's ring's direction
  const int from = static_cast<int>((rank_ + 1) % world_);
  auto piece = [&](int64_t p) {
    return std::vector<at::Tensor>{flat.narrow(0, plan.begins[p], plan.ends[p] - plan.begins[p])};
  };
  std::vector<WorkPtr> receives, sends;
  receives.reserve(plan.receives.size());
  for (int64_t p : plan.receives) {
    auto tensors = piece(p);
    receives.push_back(backend_->recv(tensors, from, base + static_cast<int>(p)));
  }
  std::thread receiver([&] {
    try {
      for (size_t k = 0; k < receives.size(); ++k) {
        if (!receives[k]->wait(timeout_)) throw std::runtime_error("a receive was aborted");
        job.set_arrived(plan.receives[k]);
      }
    } catch (...) {
      job.set_receive_error(std::current_exception());
    }
  });
  std::exception_ptr error;
  try {
    for (int64_t p : plan.sends) {
      job.wait_sendable(p, timeout_);
      auto tensors = piece(p);
      sends.push_back(backend_->send(tensors, to, base + static_cast<int>(p)));
    }
    for (const WorkPtr& work : sends) {
      if (!work->wait(timeout_)) throw std::runtime_error("a send was aborted");
    }
  } catch (...) {
    error = std::current_exception();
    for (const WorkPtr& work : receives) work->abort();  // the receiver stops waiting
    for (const WorkPtr& work : sends) work->abort();
  }
  receiver.join();
  if (error) std::rethrow_exception(error);
  std::lock_guard<std::mutex> lock(job.mutex_);
  if (job.pieces_->receive_error) std::rethrow_exception(job.pieces_->receive_error);
}

}  // namespace pyreducer
