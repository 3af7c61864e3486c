#include "bucket.h"

#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace pyreducer {

namespace {

at::Tensor make_view(const at::Tensor& flat, const at::Tensor& param, int64_t offset) {
  if (param.is_non_overlapping_and_dense()) {
    return flat.as_strided(param.sizes(), param.strides(), offset);
  }
  return flat.narrow(0, offset, param.numel()).view(param.sizes());
}

std::string describe(const std::string& name, const at::Tensor& t) {
  return name + " (" + std::string(c10::toString(t.scalar_type())) + ", " + t.device().str() + ")";
}

}  // namespace

std::string group_key(const at::Tensor& tensor) {
  return std::string(c10::toString(tensor.scalar_type())) + "/" + tensor.device().str();
}

int64_t shard_numel(int64_t numel, int64_t shards, int64_t element_size) {
  if (shards < 1 || element_size < 1 || numel < 0) {
    throw std::invalid_argument("shard_numel: expected numel >= 0, shards >= 1 and "
                                "element_size >= 1, got " + std::to_string(numel) + ", " +
                                std::to_string(shards) + ", " + std::to_string(element_size));
  }
  if (shards == 1) return numel;
  constexpr int64_t kGlooMaxSegmentBytes = 1 << 20;  // AllreduceOptions' kMaxSegmentSize
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  auto round_up = [&](int64_t a, int64_t b) { return ceil_div(a, b) * b; };
  const int64_t total_bytes = numel * element_size;
  const int64_t max_segment_bytes =
      element_size * std::max<int64_t>(1, kGlooMaxSegmentBytes / element_size);
  const int64_t segments =
      round_up(std::max(ceil_div(total_bytes, max_segment_bytes), 2 * shards), shards);
  const int64_t segment_bytes = round_up(ceil_div(total_bytes, segments), element_size);
  return segments / shards * segment_bytes / element_size;
}

void release_buffer(Bucket& bucket) {
  if (bucket.sparse || bucket.released || !bucket.flat.defined()) return;
  c10::StorageImpl* storage = bucket.flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, bucket.flat.device()));
  storage->set_nbytes(0);
  bucket.released = true;
}

void acquire_buffer(Bucket& bucket) {
  if (!bucket.released) return;
  const c10::DeviceGuard on_device(bucket.flat.device());
  c10::StorageImpl* storage = bucket.flat.storage().unsafeGetStorageImpl();
  const int64_t nbytes = size_bytes(bucket.flat);
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
  bucket.released = false;
  const int64_t slots = bucket.size_bytes / static_cast<int64_t>(bucket.flat.element_size());
  if (slots < bucket.flat.numel()) {
    bucket.flat.narrow(0, slots, bucket.flat.numel() - slots).zero_();
  }
}

void renew_buffer(Bucket& bucket) {
  if (bucket.sparse || !bucket.flat.defined()) return;
  const at::Tensor old = bucket.flat;
  const c10::Storage& old_storage = old.storage();
  // Sized as the buffer (the views are made within bounds) but without memory, until released
  // below as any released buffer.
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(size_bytes(old)),
                       c10::DataPtr(nullptr, old.device()), old_storage.allocator(),
                       old_storage.resizable());
  bucket.flat = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), old.key_set(),
                                                         old.dtype());
  bucket.flat.unsafeGetTensorImpl()->set_sizes_contiguous(old.sizes());
  for (size_t k = 0; k < bucket.views.size(); ++k) {
    const at::Tensor view = bucket.views[k];
    bucket.views[k] = bucket.flat.as_strided(view.sizes(), view.strides(), bucket.offsets[k]);
  }
  bucket.released = false;
  release_buffer(bucket);
}

void let_go_of_gradient(at::Tensor& grad) {
  if (grad.defined() && !grad.is_cpu()) {
    grad.record_stream(c10::impl::VirtualGuardImpl(grad.device().type()).getStream(grad.device()));
  }
  grad = at::Tensor();
}

int64_t size_bytes(const at::Tensor& tensor) {
  return tensor.numel() * static_cast<int64_t>(tensor.element_size());
}

BucketSet make_buckets(const std::vector<at::Tensor>& params,
                       const std::vector<std::string>& param_names,
                       const std::vector<std::vector<int64_t>>& plan,
                       const std::vector<uint8_t>& sparse, int64_t shards) {
  if (shards < 0) {
    throw std::invalid_argument("bucket plan: expected 0 (not sharded) or more shards, got " +
                                std::to_string(shards));
  }
  auto is_sparse = [&](int64_t i) { return !sparse.empty() && sparse[i]; };
  BucketSet set;
  set.locations.resize(params.size());
  std::vector<uint8_t> placed(params.size(), 0);
  set.buckets.reserve(plan.size());
  for (size_t b = 0; b < plan.size(); ++b) {
    Bucket bucket;
    bucket.param_indices = plan[b];
    if (bucket.param_indices.empty()) {
      throw std::invalid_argument("bucket plan: bucket " + std::to_string(b) + " is empty");
    }
    int64_t numel = 0;
    const int64_t first_index = bucket.param_indices.front();
    for (size_t k = 0; k < bucket.param_indices.size(); ++k) {
      const int64_t i = bucket.param_indices[k];
      if (i < 0 || i >= static_cast<int64_t>(params.size()) || placed[i]) {
        throw std::invalid_argument("bucket plan: bucket " + std::to_string(b) +
                                    " lists parameter index " + std::to_string(i) +
                                    ", which is out of range or already in a bucket");
      }
      if (group_key(params[i]) != group_key(params[first_index])) {
        throw std::invalid_argument("bucket plan: bucket " + std::to_string(b) + " mixes " +
                                    describe(param_names[i], params[i]) + " with " +
                                    describe(param_names[first_index], params[first_index]));
      }
      if (is_sparse(i) && bucket.param_indices.size() > 1) {
        throw std::invalid_argument("bucket plan: bucket " + std::to_string(b) + " holds " +
                                    param_names[i] + ", which produces sparse gradients and "
                                    "needs a bucket of its own, with " +
                                    std::to_string(bucket.param_indices.size() - 1) + " other(s)");
      }
      placed[i] = 1;
      set.locations[i] = SlotLocation{b, k};
      numel += params[i].numel();
    }
    const at::Tensor& first = params[first_index];
    if (is_sparse(first_index)) {
      bucket.sparse = true;
      bucket.size_bytes = size_bytes(first);
      bucket.offsets.push_back(0);
      bucket.pending = 1;
      set.buckets.push_back(std::move(bucket));
      continue;
    }
    const int64_t parts = std::max<int64_t>(shards, 1);
    const int64_t shard = shard_numel(numel, parts, first.element_size());
    bucket.flat = at::zeros({parts * shard}, first.options().requires_grad(false));
    if (shards > 0) bucket.shard = at::zeros({shard}, bucket.flat.options());
    bucket.size_bytes = numel * static_cast<int64_t>(first.element_size());
    int64_t offset = 0;
    for (int64_t i : bucket.param_indices) {
      bucket.views.push_back(make_view(bucket.flat, params[i], offset));
      bucket.offsets.push_back(offset);
      offset += params[i].numel();
    }
    bucket.pending = bucket.param_indices.size();
    set.buckets.push_back(std::move(bucket));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!placed[i]) {
      throw std::invalid_argument("bucket plan: parameter " + param_names[i] + " is in no bucket");
    }
  }
  return set;
}

}  // namespace pyreducer
