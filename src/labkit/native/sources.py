"""The C++ and CUDA source of one kernel, RMSNorm over float32 rows, and two bindings of it.

The kernel bodies work on raw pointers and know nothing of any framework; what differs
between the two ways of shipping them is only the binding, the few lines that turn a
framework's tensor into pointers and sizes:

- :data:`TORCH_BINDING` takes ``torch::Tensor`` arguments, so the library it builds
  calls into libtorch (``TORCH_CHECK``, ``Tensor::sizes``, the current CUDA stream) and is
  tied to the exact torch it was compiled against;
- :data:`FFI_BINDING` takes ``tvm::ffi::TensorView`` arguments, a view of a DLPack tensor,
  so the library depends only on TVM FFI's small C ABI, and any framework that exports
  DLPack (torch, NumPy, CuPy, JAX) can call it.
"""

from __future__ import annotations

ROW_KERNELS_CPU = r"""
#include <cmath>
#include <cstdint>

// out[r, :] = weight * x[r, :] / sqrt(mean(x[r, :]^2) + eps), the statistic in double.
static void rms_norm_rows_cpu(const float* x, const float* weight, float* out,
                              int64_t rows, int64_t cols, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    double sum = 0.0;
    for (int64_t c = 0; c < cols; ++c) sum += static_cast<double>(xr[c]) * xr[c];
    const float rstd = static_cast<float>(1.0 / std::sqrt(sum / cols + eps));
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = weight[c] * (xr[c] * rstd);
  }
}
"""

ROW_KERNELS_CUDA = r"""
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kThreads = 256;  // a row per block: 8 warps stride along it

// One block per row. Each thread sums the squares of its strided columns, the warps
// reduce with shuffles, warp 0 reduces the 8 warp sums, and every thread then scales
// its columns by the shared 1/rms. (Rows are read twice: simple, not the fastest.)
__global__ void rms_norm_rows_cuda(const float* __restrict__ x, const float* __restrict__ weight,
                                   float* __restrict__ out, int64_t cols, float eps) {
  const float* xr = x + blockIdx.x * cols;
  float* outr = out + blockIdx.x * cols;
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) sum += xr[c] * xr[c];
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  __shared__ float warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < kThreads / 32 ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    if (lane == 0) warp_sums[0] = sum;
  }
  __syncthreads();
  const float rstd = rsqrtf(warp_sums[0] / cols + eps);
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) outr[c] = weight[c] * (xr[c] * rstd);
}
"""

FFI_BINDING = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

namespace {
void check_rms_norm_args(const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& weight,
                         const tvm::ffi::TensorView& out, DLDeviceType device) {
  const DLDataType f32{kDLFloat, 32, 1};
  TVM_FFI_ICHECK(x.ndim() == 2) << "x must be 2-D [rows, cols], got " << x.ndim() << " dimensions";
  TVM_FFI_ICHECK(x.dtype() == f32 && weight.dtype() == f32 && out.dtype() == f32)
      << "x, weight and out must be float32";
  TVM_FFI_ICHECK(weight.ndim() == 1 && weight.size(0) == x.size(1))
      << "weight must have shape [" << x.size(1) << "]";
  TVM_FFI_ICHECK(out.ndim() == 2 && out.size(0) == x.size(0) && out.size(1) == x.size(1))
      << "out must have x's shape";
  TVM_FFI_ICHECK(x.IsContiguous() && weight.IsContiguous() && out.IsContiguous())
      << "x, weight and out must be contiguous";
  TVM_FFI_ICHECK(x.device().device_type == device && weight.device().device_type == device &&
                 out.device().device_type == device)
      << "x, weight and out must be on the device this function was built for";
}
}  // namespace
"""

FFI_CPU_ENTRY = r"""
void rms_norm(tvm::ffi::TensorView x, tvm::ffi::TensorView weight, tvm::ffi::TensorView out, double eps) {
  check_rms_norm_args(x, weight, out, kDLCPU);
  rms_norm_rows_cpu(static_cast<const float*>(x.data_ptr()), static_cast<const float*>(weight.data_ptr()),
                    static_cast<float*>(out.data_ptr()), x.size(0), x.size(1), static_cast<float>(eps));
}
"""

FFI_CUDA_ENTRY = r"""
void rms_norm(tvm::ffi::TensorView x, tvm::ffi::TensorView weight, tvm::ffi::TensorView out, double eps) {
  check_rms_norm_args(x, weight, out, kDLCUDA);
  if (x.size(0) == 0) return;
  // The caller's stream, as the framework that called set it (TVM FFI's environment).
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(x.device().device_type, x.device().device_id));
  rms_norm_rows_cuda<<<x.size(0), kThreads, 0, stream>>>(
      static_cast<const float*>(x.data_ptr()), static_cast<const float*>(weight.data_ptr()),
      static_cast<float*>(out.data_ptr()), x.size(1), static_cast<float>(eps));
  TVM_FFI_ICHECK(cudaGetLastError() == cudaSuccess) << "rms_norm launch failed";
}
"""

TORCH_BINDING = r"""
#include <torch/extension.h>

namespace {
void check_rms_norm_args(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& out,
                         torch::DeviceType device) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [rows, cols], got ", x.dim(), " dimensions");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat &&
              out.scalar_type() == torch::kFloat, "x, weight and out must be float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must have shape [", x.size(1), "]");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "x, weight and out must be contiguous");
  TORCH_CHECK(x.device().type() == device && weight.device() == x.device() && out.device() == x.device(),
              "x, weight and out must be on the device this function was built for");
}
}  // namespace
"""

TORCH_CPU_ENTRY = r"""
void rms_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor out, double eps) {
  check_rms_norm_args(x, weight, out, torch::kCPU);
  rms_norm_rows_cpu(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
                    static_cast<float>(eps));
}
"""

TORCH_CUDA_ENTRY = r"""
#include <ATen/cuda/CUDAContext.h>

void rms_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor out, double eps) {
  check_rms_norm_args(x, weight, out, torch::kCUDA);
  if (x.size(0) == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();  // libtorch's notion of "the caller's stream"
  rms_norm_rows_cuda<<<x.size(0), kThreads, 0, stream>>>(x.data_ptr<float>(), weight.data_ptr<float>(),
                                                         out.data_ptr<float>(), x.size(1), static_cast<float>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""
