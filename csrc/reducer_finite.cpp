// The opt-in finite check (check_finite=True): see Note [Finite check].
#include "reducer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <sstream>
#include <string>
#include <vector>

namespace pyreducer {

// Note [Finite check]
// With options_.check_finite, a NaN or Inf in any averaged gradient makes backward raise on
// every rank, naming the parameters and the ranks it came from, before an optimizer can read it.
//  * Before a bucket's reduction is launched (its first chunk, with or without a hook), this
//    rank records whether its own bucket holds a non-finite value: one reduction pass over the
//    bucket into a 0-dim device tensor, read by the host only if the check fails.
//  * At the end of backward, once every bucket is reduced and written back, each reduced bucket
//    is checked (one host read per iteration; on a GPU this waits for the reductions, which the
//    end of backward does not otherwise do). Every rank holds the same reduced values, so every
//    rank reaches the same verdict without communication; only when it fails do the ranks
//    exchange their local flags (all_gather_int64s) to name the ranks the values came from.
//  * A sum can also overflow (float16) with every rank's own gradient finite: the error says so.
//  * Sparse buckets and buckets skipped as unused are not checked. Not with deferred completion
//    (an overlapped optimizer): the Python wrapper refuses the combination.

void Reducer::note_local_finite(Bucket& bucket) {
  if (!options_.check_finite || bucket.sparse) return;
  at::NoGradGuard no_grad;
  bucket.local_nonfinite = at::isfinite(bucket.flat).logical_not().any();
}

namespace {

// "name (NaN)" or "name (Inf)" for each parameter of `bucket` whose reduced slot is non-finite.
std::vector<std::string> nonfinite_names(const Bucket& bucket,
                                         const std::vector<std::string>& names) {
  std::vector<std::string> found;
  for (size_t k = 0; k < bucket.views.size(); ++k) {
    const at::Tensor& view = bucket.views[k];
    if (at::isfinite(view).all().item<bool>()) continue;
    const bool nan = at::isnan(view).any().item<bool>();
    found.push_back(names[bucket.param_indices[k]] + (nan ? " (NaN)" : " (Inf)"));
  }
  return found;
}

std::string join(const std::vector<std::string>& items, size_t max_items) {
  std::ostringstream out;
  for (size_t i = 0; i < items.size() && i < max_items; ++i) out << (i ? ", " : "") << items[i];
  if (items.size() > max_items) out << " and " << items.size() - max_items << " more";
  return out.str();
}

}  // namespace

void Reducer::check_finite_reduced() {
  if (!options_.check_finite) return;
  at::NoGradGuard no_grad;
  std::vector<size_t> checked;
  std::vector<at::Tensor> bad;
  for (size_t b = 0; b < set_.buckets.size(); ++b) {
    const Bucket& bucket = set_.buckets[b];
    if (!bucket.local_nonfinite.defined() || bucket.skipped) continue;
    checked.push_back(b);
    bad.push_back(at::isfinite(bucket.flat).logical_not().any());
  }
  if (checked.empty()) return;
  const at::Tensor bad_host = at::stack(bad).to(at::kCPU);  // the one host read per iteration
  if (!bad_host.any().item<bool>()) {
    for (size_t b : checked) set_.buckets[b].local_nonfinite = at::Tensor();
    return;
  }
  // Every rank failed the same check (same reduced values): exchange the local flags.
  std::vector<int64_t> mine;
  for (size_t b : checked) mine.push_back(set_.buckets[b].local_nonfinite.item<bool>() ? 1 : 0);
  const std::vector<int64_t> all = all_gather_int64s(
      group_, mine, set_.buckets[checked.front()].flat.device(), "exchange of finite checks");
  const auto world = static_cast<size_t>(group_->getSize());
  std::ostringstream message;
  message << "pyreducer: check_finite: non-finite averaged gradients after backward of iteration "
          << stats_.iteration << " (seen on rank " << group_->getRank() << " of " << world
          << "; every rank raises this):";
  for (size_t i = 0; i < checked.size(); ++i) {
    if (!bad_host[static_cast<int64_t>(i)].item<bool>()) continue;
    const Bucket& bucket = set_.buckets[checked[i]];
    std::vector<std::string> ranks;
    for (size_t r = 0; r < world; ++r) {
      if (all[r * checked.size() + i] != 0) ranks.push_back(std::to_string(r));
    }
    message << " parameter(s) " << join(nonfinite_names(bucket, param_names_), 8) << " in bucket "
            << checked[i] << ": "
            << (ranks.empty() ? "every rank's own gradient was finite: the sum overflowed in " +
                                    std::string(c10::toString(bucket.flat.scalar_type()))
                              : "from rank(s) " + join(ranks, world) +
                                    " (their own gradients were non-finite before the reduction)")
            << ";";
  }
  message << " the gradients are written back, but no optimizer should step on them.";
  for (size_t b : checked) set_.buckets[b].local_nonfinite = at::Tensor();
  throw std::runtime_error(message.str());
}

}  // namespace pyreducer
