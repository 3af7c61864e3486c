// CUDA kernels for the bucket copy-in/copy-out and the scaled cast (see csrc/ops.h).
// Lean headers on purpose: ATen + c10/cuda only (nvcc on torch/extension.h takes ~45 s).
// Compiled with nvcc 13.0 against torch 2.15.0 (CUDA 13.2 build) by make cuda-check, and against
// torch 2.11.0 by make gpu-rehearsal; not run: no GPU
// has run them yet.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops_cuda.h"
#include "scale.h"

namespace pyreducer {
namespace {

constexpr int kThreads = 256;
// Elements one block handles (as ATen's multi_tensor_apply): the grid is sized by the total
// work, ceil(numel / kChunkElements) blocks per tensor, so a bucket mixing one large and many
// small gradients launches no empty blocks.
constexpr int64_t kChunkElements = 64 * 1024;

// Per gradient: its slot's offset in the bucket and its length. Per block: which gradient and
// which chunk of it. All metadata travels in one int64 buffer (see launch_multi_tensor).
struct Slot {
  int64_t numel;
  int64_t offset;
};
struct Work {
  int64_t tensor;
  int64_t start;
};

template <typename scalar_t, bool kCopyIn>
__global__ void multi_tensor_copy(scalar_t* flat, scalar_t* const* tensors, const Slot* slots,
                                  const Work* works, ReciprocalScale<scalar_t> scale) {
  const Work work = works[blockIdx.x];
  const Slot slot = slots[work.tensor];
  scalar_t* tensor = tensors[work.tensor];
  const int64_t end = work.start + kChunkElements < slot.numel ? work.start + kChunkElements
                                                               : slot.numel;
  for (int64_t i = work.start + threadIdx.x; i < end; i += blockDim.x) {
    if (kCopyIn) {
      flat[slot.offset + i] = scale.apply(tensor[i]);  // See Note [Rounding of the scaled copy]
    } else {
      tensor[i] = flat[slot.offset + i];
    }
  }
}

template <typename in_t, typename out_t>
__global__ void cast_scaled_kernel(const in_t* src, out_t* dst, int64_t numel,
                                   ReciprocalScale<in_t> scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = scale.template apply<out_t>(src[i]);
  }
}

int blocks_for(int64_t numel) {
  const int64_t blocks = (numel + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1024 ? (blocks < 1 ? 1 : blocks) : 1024);
}

// Launches multi_tensor_copy over contiguous `tensors` in one launch: one block per chunk of
// kChunkElements of each tensor (empty tensors get none).
template <bool kCopyIn>
void launch_multi_tensor(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets, double divisor) {
  if (tensors.empty()) return;
  const c10::cuda::CUDAGuard guard(flat.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t count = static_cast<int64_t>(tensors.size());
  int64_t blocks = 0;
  for (const at::Tensor& t : tensors) blocks += (t.numel() + kChunkElements - 1) / kChunkElements;
  if (blocks == 0) return;
  // Metadata: pointers, slots, works, in pinned host memory and one async copy to the device
  // (the caching host allocator keeps the buffer alive until the copy has run).
  at::Tensor host = at::empty({3 * count + 2 * blocks},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  int64_t* work = h + 3 * count;
  for (int64_t k = 0; k < count; ++k) {
    const at::Tensor& t = tensors[k];
    h[k] = reinterpret_cast<int64_t>(t.data_ptr());
    h[count + 2 * k] = t.numel();
    h[count + 2 * k + 1] = offsets[k];
    for (int64_t start = 0; start < t.numel(); start += kChunkElements) {
      *work++ = k;
      *work++ = start;
    }
  }
  at::Tensor meta = at::empty({host.numel()}, flat.options().dtype(at::kLong));
  meta.copy_(host, /*non_blocking=*/true);
  const int64_t* device_meta = meta.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "multi_tensor_copy",
                                  [&] {
    multi_tensor_copy<scalar_t, kCopyIn><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        flat.data_ptr<scalar_t>(), reinterpret_cast<scalar_t* const*>(device_meta),
        reinterpret_cast<const Slot*>(device_meta + count),
        reinterpret_cast<const Work*>(device_meta + 3 * count), ReciprocalScale<scalar_t>(divisor));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

void bucket_copy_in_cuda_contiguous(at::Tensor& flat, const std::vector<at::Tensor>& grads,
                                    const std::vector<int64_t>& offsets, double divisor) {
  launch_multi_tensor<true>(flat, grads, offsets, divisor);
}

void bucket_copy_out_cuda_contiguous(const at::Tensor& flat, std::vector<at::Tensor>& grads,
                                     const std::vector<int64_t>& offsets) {
  launch_multi_tensor<false>(flat, grads, offsets, 1.0);
}

at::Tensor cast_scaled_cuda(const at::Tensor& src, at::ScalarType dtype, double divisor) {
  const c10::cuda::CUDAGuard guard(src.device());
  at::Tensor in = src.reshape({-1}).contiguous();
  at::Tensor out = at::empty({in.numel()}, in.options().dtype(dtype));
  if (in.numel() == 0) return out;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "cast_scaled_in", [&] {
    using in_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "cast_scaled_out", [&] {
      cast_scaled_kernel<in_t, scalar_t><<<blocks_for(in.numel()), kThreads, 0, stream>>>(
          in.data_ptr<in_t>(), out.data_ptr<scalar_t>(), in.numel(),
          ReciprocalScale<in_t>(divisor));  // See Note [Rounding of the scaled copy]
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace pyreducer
