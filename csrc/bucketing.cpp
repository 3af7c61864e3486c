#include "bucketing.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <stdexcept>

namespace pyreducer {

namespace {

void check_inputs(const std::vector<ParamSpec>& params, const std::vector<int64_t>& walk_order,
                  const std::vector<int64_t>& caps_bytes) {
  if (caps_bytes.empty()) {
    throw std::invalid_argument("assign_buckets: expected at least one bucket cap, got none");
  }
  for (int64_t cap : caps_bytes) {
    if (cap <= 0) {
      throw std::invalid_argument("assign_buckets: expected positive bucket caps, got " +
                                  std::to_string(cap) + " bytes");
    }
  }
  if (walk_order.size() != params.size()) {
    throw std::invalid_argument("assign_buckets: expected a walk order of " +
                                std::to_string(params.size()) + " parameters, got " +
                                std::to_string(walk_order.size()));
  }
  std::vector<bool> seen(params.size(), false);
  for (int64_t index : walk_order) {
    if (index < 0 || index >= static_cast<int64_t>(params.size()) || seen[index]) {
      throw std::invalid_argument(
          "assign_buckets: expected the walk order to be a permutation of 0.." +
          std::to_string(params.size() - 1) + ", found index " + std::to_string(index) +
          (index >= 0 && index < static_cast<int64_t>(params.size()) ? " twice" : ""));
    }
    seen[index] = true;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].size_bytes < 0) {
      throw std::invalid_argument("assign_buckets: parameter " + std::to_string(i) +
                                  " has negative size " + std::to_string(params[i].size_bytes));
    }
  }
}

struct OpenBucket {
  BucketSpec spec;
  size_t closed_count = 0;  // buckets already closed in this group (selects the cap)
  int64_t last_position = -1;
};

}  // namespace

std::vector<BucketSpec> assign_buckets(const std::vector<ParamSpec>& params,
                                       const std::vector<int64_t>& walk_order,
                                       const std::vector<int64_t>& caps_bytes) {
  check_inputs(params, walk_order, caps_bytes);
  auto cap_for = [&](size_t closed_count) {
    return caps_bytes[std::min(closed_count, caps_bytes.size() - 1)];
  };

  // (walk position of last parameter, bucket)
  std::vector<std::pair<int64_t, BucketSpec>> done;
  std::map<std::string, OpenBucket> open;
  for (size_t position = 0; position < walk_order.size(); ++position) {
    const int64_t index = walk_order[position];
    if (params[index].sparse) {
      BucketSpec alone;
      alone.param_indices = {index};
      alone.size_bytes = params[index].size_bytes;
      done.emplace_back(static_cast<int64_t>(position), std::move(alone));
      continue;
    }
    OpenBucket& bucket = open[params[index].group_key];
    bucket.spec.param_indices.push_back(index);
    bucket.spec.size_bytes += params[index].size_bytes;
    bucket.spec.cap_bytes = cap_for(bucket.closed_count);
    bucket.last_position = static_cast<int64_t>(position);
    if (bucket.spec.size_bytes >= bucket.spec.cap_bytes) {
      done.emplace_back(bucket.last_position, std::move(bucket.spec));
      bucket.spec = BucketSpec{};
      bucket.closed_count += 1;
    }
  }
  for (auto& entry : open) {
    if (!entry.second.spec.param_indices.empty()) {
      done.emplace_back(entry.second.last_position, std::move(entry.second.spec));
    }
  }
  std::stable_sort(done.begin(), done.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });

  std::vector<BucketSpec> plan;
  plan.reserve(done.size());
  for (auto& entry : done) plan.push_back(std::move(entry.second));
  return plan;
}

std::vector<int64_t> reverse_order(int64_t num_params) {
  std::vector<int64_t> order(static_cast<size_t>(num_params));
  std::iota(order.rbegin(), order.rend(), 0);
  return order;
}

}  // namespace pyreducer
