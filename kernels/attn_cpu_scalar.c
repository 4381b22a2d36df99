/* Portable scalar microkernels and the drivers built on them: the fallback path, and the reference the SIMD paths
 * are tested against. */
#include <math.h>
#include <stdint.h>

#define ATTN_SUFFIX(name) name##_scalar
#define ATTN_HAS_BF16DOT 0

static void mk_gemm(int m, int n, int k, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                    int acc) {
  for (int i = 0; i < m; i++) {
    float *Ci = C + (int64_t)i * ldc;
    if (!acc)
      for (int j = 0; j < n; j++) Ci[j] = 0.0f;
    const float *Ai = A + (int64_t)i * lda;
    for (int p = 0; p < k; p++) {
      const float a = Ai[p];
      const float *Bp = B + (int64_t)p * ldb;
      for (int j = 0; j < n; j++) Ci[j] += a * Bp[j];
    }
  }
}

static float mk_rowmax(const float *x, int n) {
  float m = -INFINITY;
  for (int j = 0; j < n; j++) m = x[j] > m ? x[j] : m;
  return m;
}

static float mk_exp2_row(float *x, int n, float c, float sub) {
  float sum = 0.0f;
  for (int j = 0; j < n; j++) {
    const float e = x[j] == -INFINITY ? 0.0f : exp2f(c * x[j] - sub);
    x[j] = e;
    sum += e;
  }
  return sum;
}

#include "attn_cpu_impl.h"
