// CUDA kernels for the bucket copy-in/copy-out and the scaled cast (see csrc/ops.h).
// Lean headers on purpose: ATen + c10/cuda only (nvcc on torch/extension.h takes ~45 s).
// Compiled here with nvcc 13.0 against torch 2.14.1 (CUDA build); not run on a GPU here.
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

namespace pyreducer {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxTensorsPerLaunch = 65535;  // gridDim.y limit

// One entry per gradient: where it lives, how long it is, where its slot starts.
struct Chunk {
  int64_t numel;
  int64_t offset;
};

// blockIdx.y selects the gradient; blocks along x stride over its elements.
template <typename scalar_t, bool kCopyIn>
__global__ void multi_tensor_copy(scalar_t* flat, scalar_t* const* tensors, const Chunk* chunks,
                                  at::opmath_type<scalar_t> divisor) {
  using opmath_t = at::opmath_type<scalar_t>;
  const Chunk chunk = chunks[blockIdx.y];
  scalar_t* tensor = tensors[blockIdx.y];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunk.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (kCopyIn) {
      flat[chunk.offset + i] = static_cast<scalar_t>(static_cast<opmath_t>(tensor[i]) / divisor);
    } else {
      tensor[i] = flat[chunk.offset + i];
    }
  }
}

template <typename in_t, typename out_t>
__global__ void cast_scaled_kernel(const in_t* src, out_t* dst, int64_t numel,
                                   at::opmath_type<in_t> divisor) {
  using opmath_t = at::opmath_type<in_t>;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = static_cast<out_t>(static_cast<opmath_t>(src[i]) / divisor);
  }
}

int blocks_for(int64_t numel) {
  const int64_t blocks = (numel + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1024 ? (blocks < 1 ? 1 : blocks) : 1024);
}

// Launches multi_tensor_copy over contiguous `tensors`, at most kMaxTensorsPerLaunch per launch
// (so a bucket is one launch unless it holds more than 65535 gradients).
template <bool kCopyIn>
void launch_multi_tensor(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets, double divisor) {
  if (tensors.empty()) return;
  const c10::cuda::CUDAGuard guard(flat.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "multi_tensor_copy",
                                  [&] {
    for (size_t first = 0; first < tensors.size(); first += kMaxTensorsPerLaunch) {
      const size_t count = std::min<size_t>(kMaxTensorsPerLaunch, tensors.size() - first);
      // Metadata: pointers then chunks, in pinned host memory, one async copy to the device
      // (the caching host allocator keeps the buffer alive until the copy has run).
      at::Tensor host = at::empty({static_cast<int64_t>(count * 3)},
                                  at::TensorOptions().dtype(at::kLong).pinned_memory(true));
      int64_t* h = host.data_ptr<int64_t>();
      int64_t max_numel = 1;
      for (size_t k = 0; k < count; ++k) {
        const at::Tensor& t = tensors[first + k];
        h[k] = reinterpret_cast<int64_t>(t.data_ptr());
        h[count + 2 * k] = t.numel();
        h[count + 2 * k + 1] = offsets[first + k];
        max_numel = std::max<int64_t>(max_numel, t.numel());
      }
      at::Tensor meta = at::empty({host.numel()}, flat.options().dtype(at::kLong));
      meta.copy_(host, /*non_blocking=*/true);
      auto* device_meta = meta.data_ptr<int64_t>();
      dim3 grid(blocks_for(max_numel), static_cast<unsigned>(count));
      multi_tensor_copy<scalar_t, kCopyIn><<<grid, kThreads, 0, stream>>>(
          flat.data_ptr<scalar_t>(), reinterpret_cast<scalar_t* const*>(device_meta),
          reinterpret_cast<const Chunk*>(device_meta + count),
          static_cast<at::opmath_type<scalar_t>>(divisor));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
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
          static_cast<at::opmath_type<in_t>>(divisor));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace pyreducer
