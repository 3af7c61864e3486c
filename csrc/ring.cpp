#include "ring.h"

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "timeline.h"

namespace pyreducer {

namespace {

// A step's message goes in segments of at most kSegmentBytes, all posted at once: one message of
// megabytes each way at a time ran at half the link's rate about half the time on the emulated
// link (both directions of one TCP connection busy at once); segments keep it at the link rate.
constexpr int64_t kSegmentBytes = 256 << 10;
constexpr int kTagsPerStep = 1 << 14;                // segments of one step (4 GiB at 256 KiB)

at::Tensor ring_chunk(const at::Tensor& flat, int64_t index, int64_t world) {
  const int64_t n = flat.numel() / world;
  return flat.narrow(0, index * n, n);
}

int64_t modulo(int64_t value, int64_t world) { return ((value % world) + world) % world; }

}  // namespace

void RingJob::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return done_; });
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& error) {
      throw CollectiveError("pyreducer: " + what_ + " failed (a peer may have died or "
                            "diverged): " + error.what());
    }
  }
}

bool RingJob::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

int64_t RingJob::done_ns() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_ns_;
}

RingCollectives::RingCollectives(BackendPtr backend, std::chrono::milliseconds timeout)
    : backend_(std::move(backend)), timeout_(timeout) {
  rank_ = backend_->getRank();
  world_ = backend_->getSize();
  if (world_ > kMaxWorldSize) {
    throw std::invalid_argument("ring collectives: at most " + std::to_string(kMaxWorldSize) +
                                " ranks, got " +
                                std::to_string(world_));
  }
  worker_ = std::thread([this] { run(); });
}

RingCollectives::~RingCollectives() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

std::shared_ptr<RingJob> RingCollectives::enqueue(std::function<void()> body, std::string what) {
  return enqueue(std::make_shared<RingJob>(), std::move(body), std::move(what));
}

std::shared_ptr<RingJob> RingCollectives::enqueue(std::shared_ptr<RingJob> job,
                                                  std::function<void()> body, std::string what) {
  job->body_ = std::move(body);
  job->what_ = std::move(what) + " on rank " + std::to_string(rank_) + " of " +
               std::to_string(world_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw std::runtime_error("pyreducer: ring collectives are shut down");
    queue_.push_back(job);
  }
  cv_.notify_all();
  return job;
}

std::shared_ptr<RingJob> RingCollectives::reduce_scatter(at::Tensor flat, at::Tensor shard,
                                                         std::string what) {
  if (flat.numel() != shard.numel() * world_) {
    throw std::invalid_argument("ring reduce-scatter: expected a buffer of " +
                                std::to_string(shard.numel() * world_) +
                                " elements (shard x world size), got " +
                                std::to_string(flat.numel()));
  }
  return enqueue([this, flat, shard] { run_reduce_scatter(flat, shard); }, std::move(what));
}

std::shared_ptr<RingJob> RingCollectives::all_gather(at::Tensor flat, std::string what) {
  if (flat.numel() % world_ != 0) {
    throw std::invalid_argument("ring all-gather: expected a multiple of " +
                                std::to_string(world_) + " elements, got " +
                                std::to_string(flat.numel()));
  }
  return enqueue([this, flat] { run_all_gather(flat); }, std::move(what));
}

void RingCollectives::run() {
  at::NoGradGuard no_grad;
  for (;;) {
    std::shared_ptr<RingJob> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      job = queue_.front();
      queue_.pop_front();
    }
    std::exception_ptr error;
    if (stopping_) {
      error = std::make_exception_ptr(std::runtime_error("ring collectives shut down"));
    } else {
      try {
        job->body_();
      } catch (...) {
        error = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(job->mutex_);
      job->done_ = true;
      job->done_ns_ = Timeline::now_ns();
      job->error_ = error;
    }
    job->cv_.notify_all();
  }
}

void RingCollectives::exchange(const at::Tensor& out, const at::Tensor& in, int tag) {
  const int to = static_cast<int>(modulo(rank_ - 1, world_));  // Gloo's ring's direction
  const int from = static_cast<int>(modulo(rank_ + 1, world_));
  const int64_t segment = std::max<int64_t>(1, kSegmentBytes / out.element_size());
  const int64_t n = out.numel();
  std::vector<WorkPtr> works;
  for (int64_t begin = 0, s = 0; begin < n; begin += segment, ++s) {
    const int64_t size = std::min(segment, n - begin);
    std::vector<at::Tensor> sent{out.narrow(0, begin, size)};
    std::vector<at::Tensor> received{in.narrow(0, begin, size)};
    works.push_back(backend_->send(sent, to, tag + static_cast<int>(s)));
    works.push_back(backend_->recv(received, from, tag + static_cast<int>(s)));
  }
  for (const WorkPtr& work : works) {
    if (!work->wait(timeout_)) throw std::runtime_error("a send or receive was aborted");
  }
}

int RingCollectives::next_job_tag() {
  const int base = next_tag_;
  next_tag_ = (next_tag_ + kTagsPerJob) % (1 << 30);
  return base;
}

void RingCollectives::run_reduce_scatter(const at::Tensor& flat, const at::Tensor& shard) {
  const int base = next_job_tag();
  if (world_ == 1) {
    shard.copy_(flat);
    return;
  }
  // Step 0 sends this rank's own values (the buffer is never written); the last step receives
  // into the shard itself, then adds this rank's values: own + received, as in every step and
  // in Gloo's ring (Note [Ring collectives on Gloo]).
  at::Tensor sending = ring_chunk(flat, modulo(rank_ + 1, world_), world_);
  at::Tensor received = world_ > 2 ? at::empty_like(shard) : shard;
  for (int64_t k = 0; k < world_ - 1; ++k) {
    const bool last = k + 2 == world_;
    at::Tensor into = last ? shard : received;
    exchange(sending, into, base + static_cast<int>(k) * kTagsPerStep);
    const at::Tensor own = ring_chunk(flat, modulo(rank_ + 2 + k, world_), world_);
    if (last) {
      into.add_(own);  // chunk rank + N: this rank's
    } else {
      if (k == 0) sending = at::empty_like(shard);  // the running sums from here on
      at::add_out(sending, own, into);
    }
  }
}

void RingCollectives::run_all_gather(const at::Tensor& flat) {
  const int base = next_job_tag();
  for (int64_t k = 0; k < world_ - 1; ++k) {
    exchange(ring_chunk(flat, modulo(rank_ + k, world_), world_),
             ring_chunk(flat, modulo(rank_ + 1 + k, world_), world_),
             base + static_cast<int>(k) * kTagsPerStep);
  }
}

}  // namespace pyreducer
