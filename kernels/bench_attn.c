/* bench_attn: times t3d_attn_forward and forward+backward (ms, GFLOP/s) on B=1, H=8, S=2048, D=64/128, causal and
 * not, float32 and bfloat16. Not run by ctest. Usage: bench_attn [threads=2] [seq=2048] [reps=3] [isa=auto|scalar|
 * avx2|avx512|amx]. FLOPs count the two (fwd) or seven (fwd+bwd: 2 + 5) matrix products, halved when causal. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "t3d_attn.h"
#include "t3d_half.h"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static double cpu_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void *rand_buf(t3d_attn_dtype_t dt, size_t n, unsigned *seed) {
  void *p = malloc(n * (dt == T3D_ATTN_FLOAT32 ? 4 : 2));
  if (!p) exit(1);
  for (size_t i = 0; i < n; i++) {
    *seed = *seed * 1103515245u + 12345u;
    const float x = ((float)((*seed >> 8) & 0xffff) / 32768.0f) - 1.0f;
    if (dt == T3D_ATTN_FLOAT32)
      ((float *)p)[i] = x;
    else
      ((uint16_t *)p)[i] = t3d__f32_to_bf16(x);
  }
  return p;
}

int main(int argc, char **argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 2;
  const int64_t S = argc > 2 ? atoll(argv[2]) : 2048;
  const int reps = argc > 3 ? atoi(argv[3]) : 3;
  t3d_attn_exec_t ex = {0};
  ex.nthreads = threads;
  if (argc > 4) {
    if (!strcmp(argv[4], "scalar")) ex.isa = T3D_ATTN_ISA_SCALAR;
    if (!strcmp(argv[4], "avx2")) ex.isa = T3D_ATTN_ISA_AVX2;
    if (!strcmp(argv[4], "avx512")) ex.isa = T3D_ATTN_ISA_AVX512;
    if (!strcmp(argv[4], "amx")) ex.isa = T3D_ATTN_ISA_AMX;
  }
  const int64_t B = 1, H = 8;
  /* cpu_GF/s: GFLOP per CPU-second of this process, the per-core rate; it stays meaningful on a loaded box where
   * wall-clock numbers do not. */
  printf("%-6s %-4s %-7s %-12s %9s %9s %9s %10s %11s %10s\n", "dtype", "D", "causal", "path", "fwd_ms", "fwd_GF/s",
         "fwd_cpuGF", "fb_ms", "fb_GF/s", "fb_cpuGF");
  for (int di = 0; di < 2; di++) {
    const t3d_attn_dtype_t dt = di == 0 ? T3D_ATTN_FLOAT32 : T3D_ATTN_BFLOAT16;
    for (int64_t D = 64; D <= 128; D *= 2)
      for (int causal = 0; causal < 2; causal++) {
        const size_t n = (size_t)(B * H * S * D);
        unsigned seed = 42;
        void *q = rand_buf(dt, n, &seed), *k = rand_buf(dt, n, &seed), *v = rand_buf(dt, n, &seed);
        void *dout = rand_buf(dt, n, &seed), *out = rand_buf(dt, n, &seed);
        void *dq = rand_buf(dt, n, &seed), *dk = rand_buf(dt, n, &seed), *dv = rand_buf(dt, n, &seed);
        float *lse = (float *)malloc((size_t)(B * H * S) * sizeof(float));
        double best_f = 1e30, best_fb = 1e30, cpu_f = 0, cpu_fb = 0;
        for (int r = 0; r <= reps; r++) { /* r == 0 warms up */
          const double t0 = now_ms(), c0 = cpu_ms();
          int rc = t3d_attn_forward(dt, q, k, v, out, lse, B, H, H, S, S, D, causal, NAN, 0, 0, &ex);
          const double t1 = now_ms(), c1 = cpu_ms();
          rc |= t3d_attn_backward(dt, dout, q, k, v, out, lse, dq, dk, dv, B, H, H, S, S, D, causal, NAN, 0, 0, &ex);
          const double t2 = now_ms(), c2 = cpu_ms();
          if (rc) {
            fprintf(stderr, "attention failed: %d\n", rc);
            return 1;
          }
          if (r > 0) {
            if (t1 - t0 < best_f) best_f = t1 - t0;
            if (t2 - t0 < best_fb) best_fb = t2 - t0;
            cpu_f += (c1 - c0) / reps;
            cpu_fb += (c2 - c0) / reps;
          }
        }
        const double mm = 2.0 * (double)B * H * S * S * D * (causal ? 0.5 : 1.0); /* one [S,S,D] product */
        printf("%-6s %-4lld %-7d %-12s %9.1f %9.1f %9.1f %10.1f %11.1f %10.1f\n",
               dt == T3D_ATTN_FLOAT32 ? "fp32" : "bf16", (long long)D, causal, t3d_attn_isa_describe(ex.isa, dt),
               best_f, 2 * mm / best_f * 1e-6, 2 * mm / cpu_f * 1e-6, best_fb, 7 * mm / best_fb * 1e-6,
               7 * mm / cpu_fb * 1e-6);
        fflush(stdout);
        free(q), free(k), free(v), free(dout), free(out), free(dq), free(dk), free(dv), free(lse);
      }
  }
  return 0;
}
