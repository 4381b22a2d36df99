// reduce_cuda.cu: the device reduction that libt3d's device path (c_src/cudev/ipc.c, T3D_CUDA_PATH=ipc) calls for
// ranks that share a GPU: dst[i] = srcs[0][i] op srcs[1][i] op ... in source order, so every rank that reduces the
// same sources computes the same bytes. The contract (t3d_cuda_kernels_t in t3d.h) follows the host path's: half
// types accumulate in float32, PREMUL_SUM scales each source first (floating types only), AVG divides the sum by the
// number of sources (integers: the wrapped sum, truncating).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "t3d_reduce_cuda.h"

namespace {

constexpr int kMaxSources = 64;  // ipc.c's IPC_MAX_RANKS
constexpr int kThreads = 256;

struct Sources {
  const void *p[kMaxSources];
};

// The type a reduction accumulates in, and how values get there and back.
template <typename T> struct Acc { using type = T; };
template <> struct Acc<__half> { using type = float; };
template <> struct Acc<__nv_bfloat16> { using type = float; };

template <typename A, typename T> __device__ __forceinline__ A load(const T &v) { return static_cast<A>(v); }
template <> __device__ __forceinline__ float load<float, __half>(const __half &v) { return __half2float(v); }
template <> __device__ __forceinline__ float load<float, __nv_bfloat16>(const __nv_bfloat16 &v) {
  return __bfloat162float(v);
}
template <typename T, typename A> __device__ __forceinline__ T store(A v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half store<__half, float>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 store<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}

// Integer sums and products wrap, as on the host: computed on the unsigned type of the same width.
template <typename T> __device__ __forceinline__ T add(T a, T b) {
  if constexpr (std::is_integral<T>::value) {
    using U = typename std::make_unsigned<T>::type;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <typename T> __device__ __forceinline__ T mul(T a, T b) {
  if constexpr (std::is_integral<T>::value) {
    using U = typename std::make_unsigned<T>::type;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

template <typename T>
__global__ void reduce_kernel(T *dst, Sources srcs, int n, size_t count, int op, double scalar) {
  using A = typename Acc<T>::type;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const A s = static_cast<A>(scalar);
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    A acc = load<A>(static_cast<const T *>(srcs.p[0])[i]);
    if (op == T3D_PREMUL_SUM) acc = acc * s;
    for (int k = 1; k < n; ++k) {
      A v = load<A>(static_cast<const T *>(srcs.p[k])[i]);
      switch (op) {
        case T3D_PROD: acc = mul(acc, v); break;
        case T3D_MIN: acc = v < acc ? v : acc; break;
        case T3D_MAX: acc = v > acc ? v : acc; break;
        case T3D_PREMUL_SUM: acc = acc + v * s; break;
        default: acc = add(acc, v); break;  // SUM, AVG
      }
    }
    if (op == T3D_AVG) {
      if constexpr (std::is_integral<A>::value) {
        acc = static_cast<A>(static_cast<int64_t>(acc) / n);
      } else {
        acc = acc / static_cast<A>(n);
      }
    }
    dst[i] = store<T>(acc);
  }
}

template <typename T>
int launch(void *dst, const void *const *srcs, int n, size_t count, int op, double scalar, cudaStream_t stream) {
  Sources s{};
  for (int k = 0; k < n; ++k) s.p[k] = srcs[k];
  size_t blocks = (count + kThreads - 1) / kThreads;
  if (blocks > 4096) blocks = 4096;
  reduce_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<T *>(dst), s, n, count, op,
                                                                           scalar);
  return static_cast<int>(cudaGetLastError());
}

int reduce_supported(t3d_dtype_t dtype, t3d_redop_t op) {
  const bool floating = dtype == T3D_FLOAT16 || dtype == T3D_BFLOAT16 || dtype == T3D_FLOAT32 || dtype == T3D_FLOAT64;
  const bool integer = dtype == T3D_INT8 || dtype == T3D_UINT8 || dtype == T3D_INT32 || dtype == T3D_INT64;
  switch (op) {
    case T3D_SUM:
    case T3D_PROD:
    case T3D_MIN:
    case T3D_MAX:
    case T3D_AVG: return floating || integer;
    case T3D_PREMUL_SUM: return floating;
    default: return 0;
  }
}

int reduce(void *dst, const void *const *srcs, int nsrc, size_t count, t3d_dtype_t dtype, t3d_redop_t op,
           double scalar, void *stream) {
  if (nsrc < 1 || nsrc > kMaxSources || !reduce_supported(dtype, op)) return static_cast<int>(cudaErrorInvalidValue);
  if (count == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case T3D_INT8: return launch<int8_t>(dst, srcs, nsrc, count, op, scalar, s);
    case T3D_UINT8: return launch<uint8_t>(dst, srcs, nsrc, count, op, scalar, s);
    case T3D_INT32: return launch<int32_t>(dst, srcs, nsrc, count, op, scalar, s);
    case T3D_INT64: return launch<int64_t>(dst, srcs, nsrc, count, op, scalar, s);
    case T3D_FLOAT16: return launch<__half>(dst, srcs, nsrc, count, op, scalar, s);
    case T3D_BFLOAT16: return launch<__nv_bfloat16>(dst, srcs, nsrc, count, op, scalar, s);
    case T3D_FLOAT32: return launch<float>(dst, srcs, nsrc, count, op, scalar, s);
    case T3D_FLOAT64: return launch<double>(dst, srcs, nsrc, count, op, scalar, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

extern "C" const t3d_cuda_kernels_t *t3d_cuda_reduce_kernels(void) {
  static const t3d_cuda_kernels_t k = {reduce_supported, reduce};
  return &k;
}
