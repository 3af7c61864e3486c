// The opt-in finite check (check_finite=True): see Note [Finite check].
#include "reducer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

namespace pyreducer {

// Note [Finite check]
// With options_.check_finite, a NaN or Inf in any averaged gradient makes backward raise on
// every rank, naming the parameters and the ranks it came from, before an optimizer can read it.
//  * A bucket is tested by its sum (one vectorised pass, no temporary; float16/bfloat16 summed
//    in float32): NaN or Inf anywhere makes the sum non-finite. A finite bucket whose sum
//    overflows is flagged too, so a flagged bucket is confirmed element by element before
//    anything is reported.
//  * After each bucket's reduction is waited for, and before it is written back, its sum is
//    taken (note_reduced_finite): on the CPU while later buckets are still in flight. On the CPU
//    the flag is read at once, and if it is set this rank's own gradients, still in .grad, say
//    whether the values came from here. Where .grad will not hold them (bucket views, whose
//    .grad is the bucket) and on GPUs (where a host read per bucket would serialize host and
//    device), each rank also sums its own bucket before launching its reduction
//    (note_local_finite). The end of backward reads all flags at once (check_finite_reduced;
//    on a GPU this waits for the reductions, which the end of backward does not otherwise do).
//  * Every rank holds the same reduced values, so every rank reaches the same verdict without
//    communication; only when it fails do the ranks exchange their local flags
//    (all_gather_int64s) to name the ranks the values came from. A sum can also overflow
//    (float16 with gradient_predivide_factor=1) with every rank's gradients finite: the error
//    says so.
//  * The verdict is each rank's own, so it relies on every rank holding the same reduced values:
//    the Python wrapper refuses check_finite with join() (joined ranks shadow backward without
//    checking), with Python comm hooks (which may reduce within subgroups, or not at all) and
//    with deferred completion (an overlapped optimizer updates buckets as they complete).
//  * A failed check is raised at the very end of finalize, after a complete iteration, so that
//    training may go on after it. Sparse buckets and buckets skipped as unused are not checked.
//  * On the GPU and bucket-view paths the local flag is the sum test alone: a rank whose finite
//    gradients sum beyond the dtype's range would be named too (not confirmed element-wise).

namespace {

// A 0-dim bool tensor: the sum of `flat` is not finite (no host read).
at::Tensor sum_nonfinite(const at::Tensor& flat) {
  const bool narrow = flat.scalar_type() == at::kHalf || flat.scalar_type() == at::kBFloat16;
  const at::Tensor sum = narrow ? flat.sum(at::kFloat) : flat.sum();
  return at::isfinite(sum).logical_not();
}

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

void Reducer::note_local_finite(Bucket& bucket) {
  if (!options_.check_finite || bucket.sparse) return;
  if (bucket.flat.is_cpu() && !options_.gradient_as_bucket_view) return;  // .grad will say it
  at::NoGradGuard no_grad;
  bucket.local_nonfinite = sum_nonfinite(bucket.flat);
}

void Reducer::note_reduced_finite(size_t b) {
  Bucket& bucket = set_.buckets[b];
  if (!options_.check_finite || bucket.sparse || bucket.skipped) return;
  at::NoGradGuard no_grad;
  bucket.reduced_nonfinite = sum_nonfinite(bucket.flat);
  if (!bucket.flat.is_cpu() || bucket.local_nonfinite.defined() ||
      !bucket.reduced_nonfinite.item<bool>()) {
    return;
  }
  bool local = false;  // this rank's own gradients, not yet overwritten by the averaged ones
  for (int64_t i : bucket.param_indices) {
    const at::Tensor& grad = params_[i].grad();
    if (grad.defined() && !grad.is_sparse() && !at::isfinite(grad).all().item<bool>()) {
      local = true;
    }
  }
  bucket.local_nonfinite = at::scalar_tensor(local, at::TensorOptions().dtype(at::kBool));
}

std::string Reducer::check_finite_reduced() {
  if (!options_.check_finite) return {};
  at::NoGradGuard no_grad;
  std::vector<size_t> checked;
  std::vector<at::Tensor> flags;
  for (size_t b = 0; b < set_.buckets.size(); ++b) {
    if (!set_.buckets[b].reduced_nonfinite.defined()) continue;
    checked.push_back(b);
    // on one device (buckets of a module spread over several GPUs live on theirs)
    const c10::Device device = flags.empty() ? set_.buckets[b].reduced_nonfinite.device()
                                             : flags.front().device();
    flags.push_back(set_.buckets[b].reduced_nonfinite.to(device));
  }
  if (checked.empty()) return {};
  const at::Tensor flagged = at::stack(flags).to(at::kCPU);  // one host read per iteration
  std::vector<uint8_t> bad(checked.size(), 0);
  for (size_t i = 0; i < checked.size(); ++i) {  // a flagged sum, confirmed element by element
    bad[i] = flagged[static_cast<int64_t>(i)].item<bool>() &&
             !at::isfinite(set_.buckets[checked[i]].flat).all().item<bool>();
  }
  // (the flags are cleared by reset_iteration, which ends every finalize)
  if (std::none_of(bad.begin(), bad.end(), [](uint8_t x) { return x != 0; })) return {};
  // Every rank failed the same check (same reduced values): exchange the local flags.
  std::vector<int64_t> mine;
  for (size_t b : checked) {
    const at::Tensor& local = set_.buckets[b].local_nonfinite;
    mine.push_back(local.defined() && local.item<bool>() ? 1 : 0);
  }
  const std::vector<int64_t> all = all_gather_int64s(
      group_, mine, set_.buckets[checked.front()].flat.device(), "exchange of finite checks");
  const auto world = static_cast<size_t>(group_->getSize());
  std::ostringstream message;
  message << "pyreducer: check_finite: non-finite averaged gradients after backward of iteration "
          << stats_.iteration << " (seen on rank " << group_->getRank() << " of " << world
          << "; every rank raises this):";
  for (size_t i = 0; i < checked.size(); ++i) {
    if (!bad[i]) continue;
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
  return message.str();
}

}  // namespace pyreducer
