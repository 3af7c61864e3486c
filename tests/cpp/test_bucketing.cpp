// Table-driven tests of the pure bucket planner (csrc/bucketing.h). Built and run by ctest.
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bucketing.h"

using pyreducer::assign_buckets;
using pyreducer::BucketSpec;
using pyreducer::ParamSpec;

namespace {

constexpr int64_t kMiB = 1024 * 1024;

struct Case {
  std::string name;
  std::vector<ParamSpec> params;
  std::vector<int64_t> walk_order;  // empty: reverse order
  std::vector<int64_t> caps_bytes;
  std::vector<std::vector<int64_t>> expected;  // param indices per bucket, launch order
};

std::string show(const std::vector<std::vector<int64_t>>& buckets) {
  std::string text = "[";
  for (const auto& bucket : buckets) {
    text += "[";
    for (size_t k = 0; k < bucket.size(); ++k) text += (k ? "," : "") + std::to_string(bucket[k]);
    text += "]";
  }
  return text + "]";
}

std::vector<ParamSpec> same_group(const std::vector<int64_t>& sizes) {
  std::vector<ParamSpec> params;
  for (int64_t size : sizes) params.push_back(ParamSpec{size, "float32/cpu"});
  return params;
}

const std::vector<Case> kCases = {
    {"one bucket when everything fits", same_group({100, 200, 300}), {}, {kMiB}, {{2, 1, 0}}},
    {"reverse order, close when the cap is reached", same_group({40, 40, 40, 40}), {}, {80},
     {{3, 2}, {1, 0}}},
    {"a bucket closes at >= cap, not > cap", same_group({50, 50, 50}), {}, {100}, {{2, 1}, {0}}},
    {"first cap then later caps", same_group({10, 10, 10, 10, 10, 10}), {}, {10, 30},
     {{5}, {4, 3, 2}, {1, 0}}},
    {"a parameter larger than the cap gets its own bucket", same_group({10, 500, 10}), {}, {100},
     {{2, 1}, {0}}},
    {"explicit walk order (ready order after a rebuild)", same_group({10, 10, 10, 10}),
     {1, 3, 0, 2}, {20}, {{1, 3}, {0, 2}}},
    {"dtypes never share a bucket",
     {{100, "float32/cpu"}, {100, "float64/cpu"}, {100, "float32/cpu"}, {100, "float64/cpu"}},
     {}, {kMiB}, {{3, 1}, {2, 0}}},
    {"groups are ordered by when their last parameter arrives",
     {{10, "a"}, {10, "a"}, {10, "b"}, {10, "a"}}, {}, {20}, {{2}, {3, 1}, {0}}},
    {"each group has its own first cap",
     {{10, "a"}, {10, "b"}, {10, "a"}, {10, "b"}}, {}, {10, 100}, {{3}, {2}, {1}, {0}}},
    {"zero-size parameters are kept", same_group({0, 10, 0}), {}, {10}, {{2, 1}, {0}}},
    {"no parameters, no buckets", {}, {}, {10}, {}},
    {"a sparse parameter gets a bucket of its own, at its walk position",
     {{10, "float32/cpu"}, {10, "float32/cpu", true}, {10, "float32/cpu"}}, {}, {kMiB},
     {{1}, {2, 0}}},
    {"a sparse parameter neither fills nor closes its group's bucket",
     {{10, "float32/cpu"}, {500, "float32/cpu", true}, {10, "float32/cpu"}}, {}, {20},
     {{1}, {2, 0}}},
};

int run_cases() {
  int failures = 0;
  for (const Case& c : kCases) {
    std::vector<int64_t> order = c.walk_order.empty()
                                     ? pyreducer::reverse_order(static_cast<int64_t>(c.params.size()))
                                     : c.walk_order;
    std::vector<std::vector<int64_t>> found;
    for (const BucketSpec& bucket : assign_buckets(c.params, order, c.caps_bytes)) {
      found.push_back(bucket.param_indices);
    }
    if (found != c.expected) {
      std::printf("FAIL %s: expected %s, found %s\n", c.name.c_str(), show(c.expected).c_str(),
                  show(found).c_str());
      failures += 1;
    } else {
      std::printf("ok   %s\n", c.name.c_str());
    }
  }
  return failures;
}

int expect_invalid(const std::string& name, const std::function<void()>& call) {
  try {
    call();
  } catch (const std::invalid_argument& error) {
    std::printf("ok   %s (%s)\n", name.c_str(), error.what());
    return 0;
  }
  std::printf("FAIL %s: expected std::invalid_argument, nothing was thrown\n", name.c_str());
  return 1;
}

int run_error_cases() {
  const auto params = same_group({10, 10});
  int failures = 0;
  failures += expect_invalid("no caps", [&] { assign_buckets(params, {1, 0}, {}); });
  failures += expect_invalid("zero cap", [&] { assign_buckets(params, {1, 0}, {0}); });
  failures += expect_invalid("short walk order", [&] { assign_buckets(params, {0}, {10}); });
  failures += expect_invalid("repeated index", [&] { assign_buckets(params, {0, 0}, {10}); });
  failures += expect_invalid("index out of range", [&] { assign_buckets(params, {0, 2}, {10}); });
  return failures;
}

int check_sizes_and_caps() {
  auto plan = assign_buckets(same_group({10, 20, 30}), {2, 1, 0}, {25, 1000});
  const bool ok = plan.size() == 2 && plan[0].size_bytes == 30 && plan[0].cap_bytes == 25 &&
                  plan[1].size_bytes == 30 && plan[1].cap_bytes == 1000;
  std::printf("%s sizes and caps recorded per bucket\n", ok ? "ok  " : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  const int failures = run_cases() + run_error_cases() + check_sizes_and_caps();
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
