// attn_cuda.cu: simple tiled CUDA attention kernels (forward with online softmax, backward, merge) implementing the
// contract of t3d_attn.h. Inputs float32, bfloat16 or float16, float32 accumulation. Correctness first: one warp owns a few
// query (or key) rows, lanes split head_dim, key/query tiles are staged in shared memory as float32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#include "t3d_attn_cuda.h"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 4;                   // rows (queries or keys) a warp owns
constexpr int kBlockRows = kWarps * kRowsPerWarp; // rows a thread block owns
constexpr int kTile = 16;                         // rows of the streamed operand per shared-memory tile
constexpr int kMaxHeadDim = 256;

__device__ __forceinline__ float toF(float x) { return x; }
__device__ __forceinline__ float toF(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float toF(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T fromF(float x);
template <>
__device__ __forceinline__ float fromF<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 fromF<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half fromF<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ float warpSum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Copies rows [row0, row0 + kTile) of a [rows, d] matrix into shared memory as float32 (zeros past `rows`).
template <typename T>
__device__ __forceinline__ void loadTile(float* dst, const T* src, int64_t row0, int64_t rows, int d) {
  for (int idx = threadIdx.x; idx < kTile * d; idx += blockDim.x) {
    int j = idx / d, c = idx - j * d;
    int64_t r = row0 + j;
    dst[idx] = r < rows ? toF(src[r * d + c]) : 0.0f;
  }
}

template <typename T, int EPL>
__device__ __forceinline__ void loadRow(float (&reg)[EPL], const T* row, int d, int lane, bool ok, float mul) {
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    int c = lane + 32 * e;
    reg[e] = (ok && c < d) ? toF(row[c]) * mul : 0.0f;
  }
}

template <int EPL>
__device__ __forceinline__ float dotShared(const float (&reg)[EPL], const float* srow, int d, int lane) {
  float part = 0.0f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    int c = lane + 32 * e;
    if (c < d) part += reg[e] * srow[c];
  }
  return warpSum(part);
}

// ---- forward --------------------------------------------------------------------------------------------------

template <typename T, int EPL>
__global__ void __launch_bounds__(kThreads) fwdKernel(const T* __restrict__ q, const T* __restrict__ k,
                                                      const T* __restrict__ v, T* __restrict__ out,
                                                      float* __restrict__ lse, int hq, int hk, int64_t sq,
                                                      int64_t sk, int d, int causal, float scale, int64_t qStart,
                                                      int64_t kStart) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + kTile * d;
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / hq;
  const int h = static_cast<int>(bh % hq);
  const int hkv = h / (hq / hk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q0 = static_cast<int64_t>(blockIdx.y) * kBlockRows;
  const T* qb = q + bh * sq * d;
  const T* kb = k + (b * hk + hkv) * sk * d;
  const T* vb = v + (b * hk + hkv) * sk * d;

  float qr[kRowsPerWarp][EPL], acc[kRowsPerWarp][EPL], m[kRowsPerWarp], l[kRowsPerWarp];
  int64_t row[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row[r] = q0 + warp * kRowsPerWarp + r;
    loadRow<T, EPL>(qr[r], qb + row[r] * d, d, lane, row[r] < sq, scale);
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[r][e] = 0.0f;
  }
  // Keys past the block's last query are invisible under causal masking: stop there.
  int64_t kEnd = sk;
  if (causal) {
    int64_t lastQ = qStart + (q0 + kBlockRows < sq ? q0 + kBlockRows : sq) - 1;
    int64_t lim = lastQ - kStart + 1;
    kEnd = lim < kEnd ? lim : kEnd;
  }
  for (int64_t kt = 0; kt < kEnd; kt += kTile) {
    __syncthreads();
    loadTile<T>(ks, kb, kt, sk, d);
    loadTile<T>(vs, vb, kt, sk, d);
    __syncthreads();
    const int nk = static_cast<int>(kEnd - kt < kTile ? kEnd - kt : kTile);
    for (int j = 0; j < nk; ++j) {
      const int64_t kpos = kStart + kt + j;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        float s = dotShared<EPL>(qr[r], ks + j * d, d, lane);
        bool visible = row[r] < sq && (!causal || kpos <= qStart + row[r]);
        if (visible) {
          float mn = fmaxf(m[r], s);
          float corr = expf(m[r] - mn);
          float p = expf(s - mn);
          l[r] = l[r] * corr + p;
#pragma unroll
          for (int e = 0; e < EPL; ++e) {
            int c = lane + 32 * e;
            acc[r][e] = acc[r][e] * corr + (c < d ? p * vs[j * d + c] : 0.0f);
          }
          m[r] = mn;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (row[r] >= sq) continue;
    float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    T* orow = out + (bh * sq + row[r]) * d;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      int c = lane + 32 * e;
      if (c < d) orow[c] = fromF<T>(acc[r][e] * inv);
    }
    if (lane == 0) lse[bh * sq + row[r]] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
  }
}

// ---- backward -------------------------------------------------------------------------------------------------

// delta[row] = sum_c dout[row, c] * out[row, c]: one warp per row.
template <typename T>
__global__ void __launch_bounds__(kThreads) deltaKernel(const T* __restrict__ dout, const T* __restrict__ out,
                                                        float* __restrict__ delta, int64_t rows, int d) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  float part = 0.0f;
  for (int c = lane; c < d; c += 32) part += toF(dout[r * d + c]) * toF(out[r * d + c]);
  part = warpSum(part);
  if (lane == 0) delta[r] = part;
}

// dq: a warp owns query rows and streams the keys, recomputing p = exp(s - lse).
template <typename T, int EPL>
__global__ void __launch_bounds__(kThreads) dqKernel(const T* __restrict__ dout, const T* __restrict__ q,
                                                     const T* __restrict__ k, const T* __restrict__ v,
                                                     const float* __restrict__ lse, const float* __restrict__ delta,
                                                     T* __restrict__ dq, int hq, int hk, int64_t sq, int64_t sk,
                                                     int d, int causal, float scale, int64_t qStart,
                                                     int64_t kStart) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + kTile * d;
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / hq;
  const int h = static_cast<int>(bh % hq);
  const int hkv = h / (hq / hk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q0 = static_cast<int64_t>(blockIdx.y) * kBlockRows;
  const T* kb = k + (b * hk + hkv) * sk * d;
  const T* vb = v + (b * hk + hkv) * sk * d;

  float qr[kRowsPerWarp][EPL], dor[kRowsPerWarp][EPL], acc[kRowsPerWarp][EPL], rl[kRowsPerWarp], rd[kRowsPerWarp];
  int64_t row[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row[r] = q0 + warp * kRowsPerWarp + r;
    bool ok = row[r] < sq;
    loadRow<T, EPL>(qr[r], q + (bh * sq + row[r]) * d, d, lane, ok, scale);
    loadRow<T, EPL>(dor[r], dout + (bh * sq + row[r]) * d, d, lane, ok, 1.0f);
    rl[r] = ok ? lse[bh * sq + row[r]] : -INFINITY;
    rd[r] = ok ? delta[bh * sq + row[r]] : 0.0f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[r][e] = 0.0f;
  }
  int64_t kEnd = sk;
  if (causal) {
    int64_t lastQ = qStart + (q0 + kBlockRows < sq ? q0 + kBlockRows : sq) - 1;
    int64_t lim = lastQ - kStart + 1;
    kEnd = lim < kEnd ? lim : kEnd;
  }
  for (int64_t kt = 0; kt < kEnd; kt += kTile) {
    __syncthreads();
    loadTile<T>(ks, kb, kt, sk, d);
    loadTile<T>(vs, vb, kt, sk, d);
    __syncthreads();
    const int nk = static_cast<int>(kEnd - kt < kTile ? kEnd - kt : kTile);
    for (int j = 0; j < nk; ++j) {
      const int64_t kpos = kStart + kt + j;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        float s = dotShared<EPL>(qr[r], ks + j * d, d, lane);
        float dp = dotShared<EPL>(dor[r], vs + j * d, d, lane);
        bool visible = row[r] < sq && rl[r] != -INFINITY && (!causal || kpos <= qStart + row[r]);
        if (visible) {
          float ds = expf(s - rl[r]) * (dp - rd[r]) * scale;
#pragma unroll
          for (int e = 0; e < EPL; ++e) {
            int c = lane + 32 * e;
            if (c < d) acc[r][e] += ds * ks[j * d + c];
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (row[r] >= sq) continue;
    T* drow = dq + (bh * sq + row[r]) * d;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      int c = lane + 32 * e;
      if (c < d) drow[c] = fromF<T>(acc[r][e]);
    }
  }
}

// dk, dv: a warp owns key rows of one kv head and streams the queries of every q head that reads it.
template <typename T, int EPL>
__global__ void __launch_bounds__(kThreads) dkvKernel(const T* __restrict__ dout, const T* __restrict__ q,
                                                      const T* __restrict__ k, const T* __restrict__ v,
                                                      const float* __restrict__ lse,
                                                      const float* __restrict__ delta, T* __restrict__ dk,
                                                      T* __restrict__ dv, int hq, int hk, int64_t sq, int64_t sk,
                                                      int d, int causal, float scale, int64_t qStart,
                                                      int64_t kStart) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* dos = smem + kTile * d;
  float* ls = smem + 2 * kTile * d;
  float* dls = ls + kTile;
  const int64_t bkv = blockIdx.x;  // b * hk + kv head
  const int64_t b = bkv / hk;
  const int hkv = static_cast<int>(bkv % hk);
  const int group = hq / hk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kBlockRows;

  float kr[kRowsPerWarp][EPL], vr[kRowsPerWarp][EPL], dka[kRowsPerWarp][EPL], dva[kRowsPerWarp][EPL];
  int64_t key[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    key[r] = k0 + warp * kRowsPerWarp + r;
    bool ok = key[r] < sk;
    loadRow<T, EPL>(kr[r], k + (bkv * sk + key[r]) * d, d, lane, ok, scale);
    loadRow<T, EPL>(vr[r], v + (bkv * sk + key[r]) * d, d, lane, ok, 1.0f);
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      dka[r][e] = 0.0f;
      dva[r][e] = 0.0f;
    }
  }
  // Queries before the block's first key see none of its keys under causal masking.
  int64_t qBegin = 0;
  if (causal) {
    int64_t first = kStart + k0 - qStart;
    qBegin = first > 0 ? first : 0;
  }
  for (int g = 0; g < group; ++g) {
    const int64_t bh = b * hq + static_cast<int64_t>(hkv) * group + g;
    const T* qb = q + bh * sq * d;
    const T* db = dout + bh * sq * d;
    for (int64_t qt = qBegin; qt < sq; qt += kTile) {
      __syncthreads();
      loadTile<T>(qs, qb, qt, sq, d);
      loadTile<T>(dos, db, qt, sq, d);
      for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
        int64_t rr = qt + i;
        ls[i] = rr < sq ? lse[bh * sq + rr] : -INFINITY;
        dls[i] = rr < sq ? delta[bh * sq + rr] : 0.0f;
      }
      __syncthreads();
      const int nq = static_cast<int>(sq - qt < kTile ? sq - qt : kTile);
      for (int i = 0; i < nq; ++i) {
        const int64_t qpos = qStart + qt + i;
        const float li = ls[i];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          float s = dotShared<EPL>(kr[r], qs + i * d, d, lane);
          float dp = dotShared<EPL>(vr[r], dos + i * d, d, lane);
          bool visible = key[r] < sk && li != -INFINITY && (!causal || kStart + key[r] <= qpos);
          if (visible) {
            float p = expf(s - li);
            float ds = p * (dp - dls[i]) * scale;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
              int c = lane + 32 * e;
              if (c < d) {
                dva[r][e] += p * dos[i * d + c];
                dka[r][e] += ds * qs[i * d + c];
              }
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (key[r] >= sk) continue;
    T* krow = dk + (bkv * sk + key[r]) * d;
    T* vrow = dv + (bkv * sk + key[r]) * d;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      int c = lane + 32 * e;
      if (c < d) {
        krow[c] = fromF<T>(dka[r][e]);
        vrow[c] = fromF<T>(dva[r][e]);
      }
    }
  }
}

// ---- merge ----------------------------------------------------------------------------------------------------

template <typename TO, typename TB>
__global__ void __launch_bounds__(kThreads) mergeKernel(TO* __restrict__ out, float* __restrict__ lse,
                                                        const TB* __restrict__ bout,
                                                        const float* __restrict__ blse, int64_t rows, int d) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float a = lse[r], bl = blse[r];
  if (bl == -INFINITY) return;
  float wa, wb, nl;
  if (a == -INFINITY) {
    wa = 0.0f;
    wb = 1.0f;
    nl = bl;
  } else {
    float mx = fmaxf(a, bl);
    nl = mx + log1pf(expf(-fabsf(a - bl)));
    wa = expf(a - nl);
    wb = expf(bl - nl);
  }
  for (int c = lane; c < d; c += 32) {
    float o = wa == 0.0f ? 0.0f : toF(out[r * d + c]) * wa;
    out[r * d + c] = fromF<TO>(o + toF(bout[r * d + c]) * wb);
  }
  __syncwarp();
  if (lane == 0) lse[r] = nl;
}

// ---- launch helpers -------------------------------------------------------------------------------------------

bool argsOk(int dtype, int64_t batch, int64_t hq, int64_t hk, int64_t sq, int64_t sk, int64_t d) {
  if (dtype < 0 || dtype > 2) return false;
  if (batch < 0 || hq <= 0 || hk <= 0 || sq < 0 || sk < 0 || d <= 0 || d > kMaxHeadDim) return false;
  if (hq % hk != 0) return false;
  if (batch * hq > 0x7fffffffLL) return false;
  if ((sq + kBlockRows - 1) / kBlockRows > 65535 || (sk + kBlockRows - 1) / kBlockRows > 65535) return false;
  return true;
}

int launched() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : static_cast<int>(e);
}

template <typename T, int EPL>
int forwardT(const void* q, const void* k, const void* v, void* out, float* lse, int64_t batch, int64_t hq,
             int64_t hk, int64_t sq, int64_t sk, int64_t d, int causal, float scale, int64_t qStart, int64_t kStart,
             cudaStream_t st) {
  dim3 grid(static_cast<unsigned>(batch * hq), static_cast<unsigned>((sq + kBlockRows - 1) / kBlockRows));
  size_t shm = 2 * kTile * static_cast<size_t>(d) * sizeof(float);
  fwdKernel<T, EPL><<<grid, kThreads, shm, st>>>(static_cast<const T*>(q), static_cast<const T*>(k),
                                                 static_cast<const T*>(v), static_cast<T*>(out), lse,
                                                 static_cast<int>(hq), static_cast<int>(hk), sq, sk,
                                                 static_cast<int>(d), causal, scale, qStart, kStart);
  return launched();
}

template <typename T, int EPL>
int backwardT(const void* dout, const void* q, const void* k, const void* v, const void* out, const float* lse,
              void* dq, void* dk, void* dv, float* delta, int64_t batch, int64_t hq, int64_t hk, int64_t sq,
              int64_t sk, int64_t d, int causal, float scale, int64_t qStart, int64_t kStart, cudaStream_t st) {
  const int64_t rows = batch * hq * sq;
  const int di = static_cast<int>(d);
  if (rows > 0) {
    deltaKernel<T><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, st>>>(
        static_cast<const T*>(dout), static_cast<const T*>(out), delta, rows, di);
    int rc = launched();
    if (rc) return rc;
    dim3 grid(static_cast<unsigned>(batch * hq), static_cast<unsigned>((sq + kBlockRows - 1) / kBlockRows));
    size_t shm = 2 * kTile * static_cast<size_t>(d) * sizeof(float);
    dqKernel<T, EPL><<<grid, kThreads, shm, st>>>(
        static_cast<const T*>(dout), static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        lse, delta, static_cast<T*>(dq), static_cast<int>(hq), static_cast<int>(hk), sq, sk, di, causal, scale,
        qStart, kStart);
    rc = launched();
    if (rc) return rc;
  }
  if (batch * hk * sk > 0) {
    dim3 grid(static_cast<unsigned>(batch * hk), static_cast<unsigned>((sk + kBlockRows - 1) / kBlockRows));
    size_t shm = (2 * kTile * static_cast<size_t>(d) + 2 * kTile) * sizeof(float);
    dkvKernel<T, EPL><<<grid, kThreads, shm, st>>>(
        static_cast<const T*>(dout), static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        lse, delta, static_cast<T*>(dk), static_cast<T*>(dv), static_cast<int>(hq), static_cast<int>(hk), sq, sk,
        di, causal, scale, qStart, kStart);
    return launched();
  }
  return 0;
}

template <typename TO, typename TB>
int mergeT(void* out, float* lse, const void* bout, const float* blse, int64_t rows, int64_t d, cudaStream_t st) {
  mergeKernel<TO, TB><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, st>>>(
      static_cast<TO*>(out), lse, static_cast<const TB*>(bout), blse, rows, static_cast<int>(d));
  return launched();
}

float resolveScale(float scale, int64_t d) {
  return (isnan(scale) || scale <= 0.0f) ? 1.0f / sqrtf(static_cast<float>(d)) : scale;
}

// The block's dtype, for an out of dtype TO.
template <typename TO>
int mergeOut(int block_dtype, void* out, float* lse, const void* block_out, const float* block_lse, int64_t rows,
             int64_t head_dim, cudaStream_t st) {
  if (block_dtype == 0) return mergeT<TO, float>(out, lse, block_out, block_lse, rows, head_dim, st);
  if (block_dtype == 2) return mergeT<TO, __half>(out, lse, block_out, block_lse, rows, head_dim, st);
  return mergeT<TO, __nv_bfloat16>(out, lse, block_out, block_lse, rows, head_dim, st);
}

}  // namespace

// Dispatches on dtype and on the registers each lane needs for a head_dim row (ceil(d / 32) floats).
#define T3D_DISPATCH_EPL(d, FN, T, ...) \
  ((d) <= 32 ? FN<T, 1>(__VA_ARGS__)    \
   : (d) <= 64 ? FN<T, 2>(__VA_ARGS__)  \
   : (d) <= 128 ? FN<T, 4>(__VA_ARGS__) \
               : FN<T, 8>(__VA_ARGS__))

extern "C" int t3d_attn_cuda_forward(int dtype, const void* q, const void* k, const void* v, void* out, float* lse,
                                     int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t seq_q,
                                     int64_t seq_k, int64_t head_dim, int causal, float scale, int64_t q_start,
                                     int64_t k_start, void* stream) {
  if (!argsOk(dtype, batch, q_heads, kv_heads, seq_q, seq_k, head_dim)) return -1;
  if (batch * q_heads * seq_q == 0) return 0;
  float s = resolveScale(scale, head_dim);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (dtype == 0)
    return T3D_DISPATCH_EPL(head_dim, forwardT, float, q, k, v, out, lse, batch, q_heads, kv_heads, seq_q, seq_k,
                            head_dim, causal, s, q_start, k_start, st);
  if (dtype == 2)
    return T3D_DISPATCH_EPL(head_dim, forwardT, __half, q, k, v, out, lse, batch, q_heads, kv_heads, seq_q, seq_k,
                            head_dim, causal, s, q_start, k_start, st);
  return T3D_DISPATCH_EPL(head_dim, forwardT, __nv_bfloat16, q, k, v, out, lse, batch, q_heads, kv_heads, seq_q,
                          seq_k, head_dim, causal, s, q_start, k_start, st);
}

extern "C" int t3d_attn_cuda_backward(int dtype, const void* dout, const void* q, const void* k, const void* v,
                                      const void* out, const float* lse, void* dq, void* dk, void* dv,
                                      float* workspace, int64_t batch, int64_t q_heads, int64_t kv_heads,
                                      int64_t seq_q, int64_t seq_k, int64_t head_dim, int causal, float scale,
                                      int64_t q_start, int64_t k_start, void* stream) {
  if (!argsOk(dtype, batch, q_heads, kv_heads, seq_q, seq_k, head_dim)) return -1;
  float s = resolveScale(scale, head_dim);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (dtype == 0)
    return T3D_DISPATCH_EPL(head_dim, backwardT, float, dout, q, k, v, out, lse, dq, dk, dv, workspace, batch,
                            q_heads, kv_heads, seq_q, seq_k, head_dim, causal, s, q_start, k_start, st);
  if (dtype == 2)
    return T3D_DISPATCH_EPL(head_dim, backwardT, __half, dout, q, k, v, out, lse, dq, dk, dv, workspace, batch,
                            q_heads, kv_heads, seq_q, seq_k, head_dim, causal, s, q_start, k_start, st);
  return T3D_DISPATCH_EPL(head_dim, backwardT, __nv_bfloat16, dout, q, k, v, out, lse, dq, dk, dv, workspace, batch,
                          q_heads, kv_heads, seq_q, seq_k, head_dim, causal, s, q_start, k_start, st);
}

extern "C" int t3d_attn_cuda_merge(int out_dtype, void* out, float* lse, int block_dtype, const void* block_out,
                                   const float* block_lse, int64_t rows, int64_t head_dim, void* stream) {
  if (out_dtype < 0 || out_dtype > 2 || block_dtype < 0 || block_dtype > 2) return -1;
  if (rows < 0 || head_dim <= 0) return -1;
  if (rows == 0) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (out_dtype == 0) return mergeOut<float>(block_dtype, out, lse, block_out, block_lse, rows, head_dim, st);
  if (out_dtype == 2) return mergeOut<__half>(block_dtype, out, lse, block_out, block_lse, rows, head_dim, st);
  return mergeOut<__nv_bfloat16>(block_dtype, out, lse, block_out, block_lse, rows, head_dim, st);
}

extern "C" const char* t3d_attn_cuda_error_string(int code) {
  if (code == -1) return "invalid argument";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
