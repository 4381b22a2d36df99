/* AVX-512 microkernels (F/BW/VL, compiled with those flags) and the drivers built on them. The bfloat16 GEMM uses
 * vdpbf16ps and carries its own target attribute: it is only called when the CPU reports AVX512_BF16. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ATTN_SUFFIX(name) name##_avx512
#define ATTN_HAS_BF16DOT 1

static inline __mmask16 tail_mask16(int r) { return r >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << r) - 1u); }

/* C[MR x 16 NV] (+)= A[MR x k] B[k x 16 NV], float32, A element (r, p) at A[r sar + p sap] (sap = 1: A row-major;
 * sar = 1: A stored transposed). The last vector of the tile is masked by lastm. Up to 8 x 3 accumulators: per
 * step 3 vector loads and 8 broadcasts feed 24 FMAs, and a 48-column panel of B (k x 192 bytes) stays in L1 while
 * the row blocks walk down A. */
static inline __attribute__((always_inline)) void tile_f32(const int MR, const int NV, const int FULL,
                                                           __mmask16 lastm, int k,
                                                           const float *A, int64_t sar, int64_t sap,
                                                           const float *B, int ldb, float *C, int ldc, int acc) {
  __m512 c[8][3];
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) {
      const __mmask16 mk = v == NV - 1 ? lastm : (__mmask16)0xffff;
      c[r][v] = acc ? _mm512_maskz_loadu_ps(mk, C + (int64_t)r * ldc + 16 * v) : _mm512_setzero_ps();
    }
  const float *Ap = A;
  const float *Bp = B;
  for (int p = 0; p < k; p++, Ap += sap, Bp += ldb) {
    __m512 bv[3];
    for (int v = 0; v < NV; v++)
      bv[v] = (FULL || v != NV - 1) ? _mm512_loadu_ps(Bp + 16 * v) : _mm512_maskz_loadu_ps(lastm, Bp + 16 * v);
    for (int r = 0; r < MR; r++) {
      const __m512 a = _mm512_set1_ps(Ap[r * sar]);
      for (int v = 0; v < NV; v++) c[r][v] = _mm512_fmadd_ps(a, bv[v], c[r][v]);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) {
      const __mmask16 mk = v == NV - 1 ? lastm : (__mmask16)0xffff;
      _mm512_mask_storeu_ps(C + (int64_t)r * ldc + 16 * v, mk, c[r][v]);
    }
}

#define TILE_ROWS(NV, FULL, ...)                              \
  switch (mr) {                                               \
    case 1: tile_f32(1, NV, FULL, __VA_ARGS__); break;        \
    case 2: tile_f32(2, NV, FULL, __VA_ARGS__); break;        \
    case 3: tile_f32(3, NV, FULL, __VA_ARGS__); break;        \
    case 4: tile_f32(4, NV, FULL, __VA_ARGS__); break;        \
    case 5: tile_f32(5, NV, FULL, __VA_ARGS__); break;        \
    case 6: tile_f32(6, NV, FULL, __VA_ARGS__); break;        \
    case 7: tile_f32(7, NV, FULL, __VA_ARGS__); break;        \
    default: tile_f32(8, NV, FULL, __VA_ARGS__); break;       \
  }

/* C (+)= A B with A element (i, p) at A[i sar + p sap]. */
static void gemm_strided(int m, int n, int k, const float *A, int64_t sar, int64_t sap, const float *B, int ldb,
                         float *C, int ldc, int acc) {
  /* Panels of 48 columns, but 32 + 32 rather than 48 + 16 where 64 remain (head_dim 64): a one-vector panel would
   * spend a broadcast per FMA. */
  for (int j = 0, w; j < n; j += w) {
    const int rem = n - j;
    w = rem > 64 || rem == 48 ? 48 : rem > 32 ? 32 : rem;
    const int nv = (w + 15) / 16;
    const __mmask16 lastm = tail_mask16(w - 16 * (nv - 1));
    for (int i = 0; i < m; i += 8) {
      const int mr = m - i >= 8 ? 8 : m - i;
      const float *Ai = A + (int64_t)i * sar;
      float *Ci = C + (int64_t)i * ldc + j;
      if (nv == 3 && lastm == (__mmask16)0xffff) { /* the common case: no masked loads in the k loop */
        TILE_ROWS(3, 1, lastm, k, Ai, sar, sap, B + j, ldb, Ci, ldc, acc)
      } else if (nv == 3) {
        TILE_ROWS(3, 0, lastm, k, Ai, sar, sap, B + j, ldb, Ci, ldc, acc)
      } else if (nv == 2 && lastm == (__mmask16)0xffff) {
        TILE_ROWS(2, 1, lastm, k, Ai, sar, sap, B + j, ldb, Ci, ldc, acc)
      } else if (nv == 2) {
        TILE_ROWS(2, 0, lastm, k, Ai, sar, sap, B + j, ldb, Ci, ldc, acc)
      } else {
        TILE_ROWS(1, 0, lastm, k, Ai, sar, sap, B + j, ldb, Ci, ldc, acc)
      }
    }
  }
}

static void mk_gemm(int m, int n, int k, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                    int acc) {
  gemm_strided(m, n, k, A, lda, 1, B, ldb, C, ldc, acc);
}

/* C[m x n] (+)= A^T B with A stored [k x m] (leading dimension lda). */
#define ATTN_HAS_GEMM_AT 1
static void mk_gemm_at(int m, int n, int k, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                       int acc) {
  gemm_strided(m, n, k, A, 1, lda, B, ldb, C, ldc, acc);
}

#define TILE_CASES(FN, ...)                                                                                        \
  switch ((mr - 1) * 4 + (nv - 1)) {                                                                             \
    case 0: FN(1, 1, __VA_ARGS__); break;                                                                        \
    case 1: FN(1, 2, __VA_ARGS__); break;                                                                        \
    case 2: FN(1, 3, __VA_ARGS__); break;                                                                        \
    case 3: FN(1, 4, __VA_ARGS__); break;                                                                        \
    case 4: FN(2, 1, __VA_ARGS__); break;                                                                        \
    case 5: FN(2, 2, __VA_ARGS__); break;                                                                        \
    case 6: FN(2, 3, __VA_ARGS__); break;                                                                        \
    case 7: FN(2, 4, __VA_ARGS__); break;                                                                        \
    case 8: FN(3, 1, __VA_ARGS__); break;                                                                        \
    case 9: FN(3, 2, __VA_ARGS__); break;                                                                        \
    case 10: FN(3, 3, __VA_ARGS__); break;                                                                       \
    case 11: FN(3, 4, __VA_ARGS__); break;                                                                       \
    case 12: FN(4, 1, __VA_ARGS__); break;                                                                       \
    case 13: FN(4, 2, __VA_ARGS__); break;                                                                       \
    case 14: FN(4, 3, __VA_ARGS__); break;                                                                       \
    default: FN(4, 4, __VA_ARGS__); break;                                                                       \
  }

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

/* As tile_f32 with A bfloat16 row-major and B bfloat16 packed in pairs; kp counts pairs. */
static inline __attribute__((always_inline)) BF16_TARGET void tile_bf16(const int MR, const int NV,
                                                                        __mmask16 lastm, int kp,
                                                                        const uint16_t *A, int lda,
                                                                        const uint16_t *B, int ldb, float *C,
                                                                        int ldc, int acc) {
  __m512 c[4][4];
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) {
      const __mmask16 mk = v == NV - 1 ? lastm : (__mmask16)0xffff;
      c[r][v] = acc ? _mm512_maskz_loadu_ps(mk, C + (int64_t)r * ldc + 16 * v) : _mm512_setzero_ps();
    }
  for (int p = 0; p < kp; p++) {
    __m512i bv[4];
    const uint16_t *Bp = B + (int64_t)p * ldb * 2;
    for (int v = 0; v < NV; v++)
      bv[v] = v == NV - 1 ? _mm512_maskz_loadu_epi32(lastm, Bp + 32 * v) : _mm512_loadu_si512(Bp + 32 * v);
    for (int r = 0; r < MR; r++) {
      int32_t pair;
      memcpy(&pair, A + (int64_t)r * lda + 2 * p, sizeof pair);
      const __m512i a = _mm512_set1_epi32(pair);
      for (int v = 0; v < NV; v++) c[r][v] = _mm512_dpbf16_ps(c[r][v], (__m512bh)a, (__m512bh)bv[v]);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) {
      const __mmask16 mk = v == NV - 1 ? lastm : (__mmask16)0xffff;
      _mm512_mask_storeu_ps(C + (int64_t)r * ldc + 16 * v, mk, c[r][v]);
    }
}

static BF16_TARGET __attribute__((noinline)) void mk_gemm_bf16(int m, int n, int kp, const uint16_t *A, int lda,
                                                               const uint16_t *B, int ldb, float *C, int ldc,
                                                               int acc) {
  for (int j = 0; j < n; j += 64) {
    const int nv = (n - j) >= 64 ? 4 : (n - j + 15) / 16;
    const __mmask16 lastm = tail_mask16(n - j - 16 * (nv - 1));
    for (int i = 0; i < m; i += 4) {
      const int mr = m - i >= 4 ? 4 : m - i;
      TILE_CASES(tile_bf16, lastm, kp, A + (int64_t)i * lda, lda, B + (int64_t)j * 2, ldb,
                 C + (int64_t)i * ldc + j, ldc, acc)
    }
  }
}

/* dst[0..n) = bfloat16(src), round to nearest even (vcvtne2ps2bf16; P holds no NaN), dst[n] = 0 when n is odd. */
static BF16_TARGET __attribute__((noinline)) void mk_cvt_bf16_row(const float *src, int n, uint16_t *dst) {
  int j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + j + 16), _mm512_loadu_ps(src + j));
    _mm512_storeu_si512(dst + j, (__m512i)h);
  }
  for (; j + 16 <= n; j += 16) _mm256_storeu_si256((__m256i *)(dst + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
  if (j < n) {
    const __m512 x = _mm512_maskz_loadu_ps(tail_mask16(n - j), src + j);
    _mm256_mask_storeu_epi16(dst + j, tail_mask16(n - j + (n & 1)), (__m256i)_mm512_cvtneps_pbh(x));
  } else if (n & 1) {
    dst[n] = 0;
  }
}

static float mk_rowmax(const float *x, int n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + j));
  if (j < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask16(n - j), x + j));
  return _mm512_reduce_max_ps(m);
}

/* 2^x for x <= ~8 (the forward subtracts a running maximum at most 2^8 below the scores, the backward the lse):
 * x = n + f with |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error < 1.3e-7), then scalef.
 * Clamping at -150 makes -inf (a masked score) an exact 0. */
static inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-04f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

static float mk_exp2_row(float *x, int n, float c, float sub) {
  const __m512 vc = _mm512_set1_ps(c), vs = _mm512_set1_ps(sub);
  __m512 sum = _mm512_setzero_ps();
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp2_ps(_mm512_fmsub_ps(vc, _mm512_loadu_ps(x + j), vs));
    _mm512_storeu_ps(x + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __mmask16 mk = tail_mask16(n - j);
    const __m512 e = exp2_ps(_mm512_fmsub_ps(vc, _mm512_maskz_loadu_ps(mk, x + j), vs));
    _mm512_mask_storeu_ps(x + j, mk, e);
    sum = _mm512_mask_add_ps(sum, mk, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

#include "attn_cpu_impl.h"
