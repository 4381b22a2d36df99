/* AVX2 + FMA microkernels and the drivers built on them (bfloat16 inputs are widened to float32 when packed). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define ATTN_SUFFIX(name) name##_avx2
#define ATTN_HAS_BF16DOT 0

static const int32_t tail_tbl[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
/* First r (1..8) lanes set. */
static inline __m256i tail_mask8(int r) { return _mm256_loadu_si256((const __m256i *)(tail_tbl + 8 - (r > 8 ? 8 : r))); }

/* C[MR x 8 NV] (+)= A[MR x k] B[k x 8 NV]; the last vector is masked by lastm. */
static inline __attribute__((always_inline)) void tile_f32(const int MR, const int NV, __m256i lastm, int k,
                                                           const float *A, int lda, const float *B, int ldb,
                                                           float *C, int ldc, int acc) {
  __m256 c[4][3];
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) {
      const float *src = C + (int64_t)r * ldc + 8 * v;
      c[r][v] = !acc ? _mm256_setzero_ps() : v == NV - 1 ? _mm256_maskload_ps(src, lastm) : _mm256_loadu_ps(src);
    }
  for (int p = 0; p < k; p++) {
    __m256 bv[3];
    const float *Bp = B + (int64_t)p * ldb;
    for (int v = 0; v < NV; v++)
      bv[v] = v == NV - 1 ? _mm256_maskload_ps(Bp + 8 * v, lastm) : _mm256_loadu_ps(Bp + 8 * v);
    for (int r = 0; r < MR; r++) {
      const __m256 a = _mm256_broadcast_ss(A + (int64_t)r * lda + p);
      for (int v = 0; v < NV; v++) c[r][v] = _mm256_fmadd_ps(a, bv[v], c[r][v]);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) {
      float *dst = C + (int64_t)r * ldc + 8 * v;
      if (v == NV - 1)
        _mm256_maskstore_ps(dst, lastm, c[r][v]);
      else
        _mm256_storeu_ps(dst, c[r][v]);
    }
}

static void mk_gemm(int m, int n, int k, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                    int acc) {
  for (int j = 0; j < n; j += 24) {
    const int nv = (n - j) >= 24 ? 3 : (n - j + 7) / 8;
    const __m256i lastm = tail_mask8(n - j - 8 * (nv - 1));
    for (int i = 0; i < m; i += 4) {
      const int mr = m - i >= 4 ? 4 : m - i;
      const float *Ai = A + (int64_t)i * lda;
      float *Ci = C + (int64_t)i * ldc + j;
#define T(MR, NV) tile_f32(MR, NV, lastm, k, Ai, lda, B + j, ldb, Ci, ldc, acc)
      switch ((mr - 1) * 3 + (nv - 1)) {
        case 0: T(1, 1); break;
        case 1: T(1, 2); break;
        case 2: T(1, 3); break;
        case 3: T(2, 1); break;
        case 4: T(2, 2); break;
        case 5: T(2, 3); break;
        case 6: T(3, 1); break;
        case 7: T(3, 2); break;
        case 8: T(3, 3); break;
        case 9: T(4, 1); break;
        case 10: T(4, 2); break;
        default: T(4, 3); break;
      }
#undef T
    }
  }
}

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

static float mk_rowmax(const float *x, int n) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 m = ninf;
  int j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  if (j < n) {
    const __m256i mk = tail_mask8(n - j);
    m = _mm256_max_ps(m, _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + j, mk), _mm256_castsi256_ps(mk)));
  }
  return hmax8(m);
}

/* 2^x as in the AVX-512 file; without scalef the power of two is built in the exponent field, and anything below
 * -126 (a masked -inf score included) is flushed to an exact 0. */
static inline __m256 exp2_ps(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static float mk_exp2_row(float *x, int n, float c, float sub) {
  const __m256 vc = _mm256_set1_ps(c), vs = _mm256_set1_ps(sub);
  __m256 sum = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp2_ps(_mm256_fmsub_ps(vc, _mm256_loadu_ps(x + j), vs));
    _mm256_storeu_ps(x + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float s = hsum8(sum);
  for (; j < n; j++) {
    const float e = x[j] == -INFINITY ? 0.0f : exp2f(c * x[j] - sub);
    x[j] = e;
    s += e;
  }
  return s;
}

#include "attn_cpu_impl.h"
