// Bucket assignment: a pure function from parameter sizes and groups to a bucket plan.
//
// Vocabulary (used across csrc/ and pyreducer/):
//   bucket     one flat buffer that is all-reduced as a whole;
//   slot/view  one parameter's slice of a bucket;
//   group key  the (dtype, device) pair a parameter belongs to; a bucket never mixes groups;
//   walk order the order in which parameters are offered to the planner, which approximates the
//              order in which their gradients become ready (reverse definition order by default,
//              the observed ready order after a rebuild).
//
// This file knows nothing of torch or Python, so it builds and is unit-tested on its own
// (tests/cpp/test_bucketing.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pyreducer {

// 1 MiB: the cap of the first bucket of each group when the user keeps the default cap, as torch
// DDP does (a small first bucket starts communication early).
constexpr int64_t kDefaultFirstBucketCapBytes = 1024 * 1024;
// 25 MiB: torch DDP's default bucket_cap_mb.
constexpr int64_t kDefaultBucketCapBytes = 25 * 1024 * 1024;

struct ParamSpec {
  int64_t size_bytes = 0;  // numel * element size
  std::string group_key;   // e.g. "float32/cpu"; parameters with different keys never share a bucket
  bool sparse = false;     // produces sparse gradients (nn.Embedding(sparse=True)): a bucket of its own
};

struct BucketSpec {
  std::vector<int64_t> param_indices;  // indices into the ParamSpec list, in walk order (= slot order)
  int64_t size_bytes = 0;              // sum of the parameters' size_bytes
  int64_t cap_bytes = 0;               // the cap that was in force while this bucket was filled
};

// Partitions parameters into buckets.
//
// Walks `walk_order` (a permutation of 0..params.size()-1); for each group key, parameters are
// appended to that group's open bucket, which is closed once its size reaches the cap in force.
// The i-th bucket closed in a group uses caps_bytes[i], or the last entry once the list runs out
// (so {1 MiB, 25 MiB} means "first bucket 1 MiB, the rest 25 MiB"). A sparse parameter gets a
// bucket of its own, closed at its walk position; it neither joins nor closes its group's open
// bucket, and counts for no cap (as torch DDP's compute_bucket_assignment_by_size).
//
// Buckets come back in launch order: sorted by the walk position of their last parameter (the
// moment the whole bucket can be ready if gradients arrive in walk order), ties kept stable.
//
// Throws std::invalid_argument if walk_order is not a permutation, caps_bytes is empty or holds a
// non-positive cap, or a size is negative. Thread-safe (no shared state).
std::vector<BucketSpec> assign_buckets(const std::vector<ParamSpec>& params,
                                       const std::vector<int64_t>& walk_order,
                                       const std::vector<int64_t>& caps_bytes);

// The default walk order: parameters in reverse definition order (n-1, ..., 0).
std::vector<int64_t> reverse_order(int64_t num_params);

}  // namespace pyreducer
