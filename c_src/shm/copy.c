/* copy.c: the data movers of the shared-memory collectives: copies with optional non-temporal stores and an
 * n-source reduction (one pass over all sources; AVX-512 or AVX for float32 / float64 sum, tiles through
 * t3d__reduce for the rest). Chosen at run time from what the CPU has. */
#include "shm.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define T3D_SHM_X86 1
#endif

enum { ISA_NONE = 0, ISA_AVX = 1, ISA_AVX512 = 2 };

static int isa(void) {
  static int cached = -1;
  int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (v >= 0) return v;
  v = ISA_NONE;
#ifdef T3D_SHM_X86
  int64_t bits = t3d__param_int(T3D_PARAM_SHM_SIMD); /* tests run the narrower paths on wider CPUs */
  __builtin_cpu_init();
  if (bits >= 512 && __builtin_cpu_supports("avx512f")) v = ISA_AVX512;
  else if (bits >= 256 && __builtin_cpu_supports("avx")) v = ISA_AVX;
#endif
  __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
  return v;
}

int t3d__shm_nt_available(void) { return isa() != ISA_NONE; }

/* Whether two cores of this machine may sit on different last-level caches, where a line one core wrote reaches
 * another faster from memory (non-temporal stores) than from the writer's cache: the core complexes of AMD's CPUs
 * (the placement probe, sync.c). An Intel CPU's cores share one L3 per socket, and a reader finds the writer's
 * lines there or in the writer's L2; non-temporal stores only send them to memory (measured: docs/architecture.md,
 * "Not on Intel CPUs"). Anything not known to be Intel's answers yes. */
int t3d__shm_llc_may_split(void) {
#ifdef T3D_SHM_X86
  __builtin_cpu_init();
  return !__builtin_cpu_is("intel");
#else
  return 1;
#endif
}

/* ---------- copies ---------- */

#ifdef T3D_SHM_X86
/* Stores that bypass the cache: the destination (a user buffer larger than the caches) is not read back soon, and
 * a normal store would first read every line it writes. */
__attribute__((target("avx512f"))) static void stream_avx512(char *d, const char *s, size_t n) {
  size_t head = (64 - ((uintptr_t)d & 63)) & 63;
  if (head > n) head = n;
  memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  for (; n >= 256; n -= 256, d += 256, s += 256) {
    __m512i a = _mm512_loadu_si512((const void *)s), b = _mm512_loadu_si512((const void *)(s + 64));
    __m512i c = _mm512_loadu_si512((const void *)(s + 128)), e = _mm512_loadu_si512((const void *)(s + 192));
    _mm512_stream_si512((void *)d, a);
    _mm512_stream_si512((void *)(d + 64), b);
    _mm512_stream_si512((void *)(d + 128), c);
    _mm512_stream_si512((void *)(d + 192), e);
  }
  for (; n >= 64; n -= 64, d += 64, s += 64) _mm512_stream_si512((void *)d, _mm512_loadu_si512((const void *)s));
  memcpy(d, s, n);
}

__attribute__((target("avx512f"))) static void copy_nt_avx512(char *d, const char *s, size_t n) {
  stream_avx512(d, s, n);
  _mm_sfence();
}

__attribute__((target("avx"))) static void stream_avx(char *d, const char *s, size_t n) {
  size_t head = (32 - ((uintptr_t)d & 31)) & 31;
  if (head > n) head = n;
  memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  for (; n >= 128; n -= 128, d += 128, s += 128) {
    __m256i a = _mm256_loadu_si256((const __m256i *)s), b = _mm256_loadu_si256((const __m256i *)(s + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64)), e = _mm256_loadu_si256((const __m256i *)(s + 96));
    _mm256_stream_si256((__m256i *)d, a);
    _mm256_stream_si256((__m256i *)(d + 32), b);
    _mm256_stream_si256((__m256i *)(d + 64), c);
    _mm256_stream_si256((__m256i *)(d + 96), e);
  }
  for (; n >= 32; n -= 32, d += 32, s += 32)
    _mm256_stream_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
  memcpy(d, s, n);
}

__attribute__((target("avx"))) static void copy_nt_avx(char *d, const char *s, size_t n) {
  stream_avx(d, s, n);
  _mm_sfence();
}
#endif

void t3d__shm_copy(void *dst, const void *src, size_t n, int nt) {
  if (n == 0 || dst == src) return;
#ifdef T3D_SHM_X86
  if (nt && n >= 1024) {
    int v = isa();
    if (v == ISA_AVX512) {
      copy_nt_avx512(dst, src, n);
      return;
    }
    if (v == ISA_AVX) {
      copy_nt_avx(dst, src, n);
      return;
    }
  }
#endif
  memcpy(dst, src, n);
}

void t3d_copy_stream(void *dst, const void *src, size_t bytes) {
#ifdef T3D_SHM_X86
  int v = isa();
  if (v == ISA_AVX512) return copy_nt_avx512(dst, src, bytes);
  if (v == ISA_AVX) return copy_nt_avx(dst, src, bytes);
#endif
  memmove(dst, src, bytes);
}

/* ---------- reductions ---------- */

#ifdef T3D_SHM_X86
/* Sums element by element in source order; the scalar tail adds in the same order, so the result does not depend
 * on where a vector block starts (every rank gets the same bits). */
#define DEFINE_SUM(NAME, TARGET, T, V, LOAD, ADD, STORE, STREAM, LANES)                                       \
  __attribute__((target(TARGET))) static void NAME(T *d, T *d2, const T *const *s, int ns, size_t n, int nt) {  \
    size_t i = 0;                                                                                              \
    /* The non-temporal destination needs 64-byte alignment: reach it with scalar elements first. */           \
    if (d2 != NULL && nt) {                                                                                    \
      if (((uintptr_t)d2 % sizeof(T)) != 0) nt = 0;                                                            \
      for (; nt && i < n && ((uintptr_t)(d2 + i) & 63) != 0; i++) {                                            \
        T acc = s[0][i];                                                                                       \
        for (int p = 1; p < ns; p++) acc += s[p][i];                                                           \
        if (d != NULL) d[i] = acc;                                                                             \
        d2[i] = acc;                                                                                           \
      }                                                                                                        \
    }                                                                                                          \
    for (; i + 4 * LANES <= n; i += 4 * LANES) {                                                               \
      V a0 = LOAD(s[0] + i), a1 = LOAD(s[0] + i + LANES);                                                      \
      V a2 = LOAD(s[0] + i + 2 * LANES), a3 = LOAD(s[0] + i + 3 * LANES);                                      \
      for (int p = 1; p < ns; p++) {                                                                           \
        const T *q = s[p] + i;                                                                                 \
        a0 = ADD(a0, LOAD(q));                                                                                 \
        a1 = ADD(a1, LOAD(q + LANES));                                                                         \
        a2 = ADD(a2, LOAD(q + 2 * LANES));                                                                     \
        a3 = ADD(a3, LOAD(q + 3 * LANES));                                                                     \
      }                                                                                                        \
      if (d != NULL) {                                                                                         \
        STORE(d + i, a0);                                                                                      \
        STORE(d + i + LANES, a1);                                                                              \
        STORE(d + i + 2 * LANES, a2);                                                                          \
        STORE(d + i + 3 * LANES, a3);                                                                          \
      }                                                                                                        \
      if (d2 != NULL) {                                                                                        \
        if (nt) {                                                                                              \
          STREAM(d2 + i, a0);                                                                                  \
          STREAM(d2 + i + LANES, a1);                                                                          \
          STREAM(d2 + i + 2 * LANES, a2);                                                                      \
          STREAM(d2 + i + 3 * LANES, a3);                                                                      \
        } else {                                                                                               \
          STORE(d2 + i, a0);                                                                                   \
          STORE(d2 + i + LANES, a1);                                                                           \
          STORE(d2 + i + 2 * LANES, a2);                                                                       \
          STORE(d2 + i + 3 * LANES, a3);                                                                       \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
    for (; i < n; i++) {                                                                                       \
      T acc = s[0][i];                                                                                         \
      for (int p = 1; p < ns; p++) acc += s[p][i];                                                             \
      if (d != NULL) d[i] = acc;                                                                               \
      if (d2 != NULL) d2[i] = acc;                                                                             \
    }                                                                                                          \
    if (d2 != NULL && nt) _mm_sfence();                                                                        \
  }

DEFINE_SUM(sum_f32_avx512, "avx512f", float, __m512, _mm512_loadu_ps, _mm512_add_ps, _mm512_storeu_ps,
           _mm512_stream_ps, 16)
DEFINE_SUM(sum_f64_avx512, "avx512f", double, __m512d, _mm512_loadu_pd, _mm512_add_pd, _mm512_storeu_pd,
           _mm512_stream_pd, 8)
DEFINE_SUM(sum_f32_avx, "avx", float, __m256, _mm256_loadu_ps, _mm256_add_ps, _mm256_storeu_ps, _mm256_stream_ps, 8)
DEFINE_SUM(sum_f64_avx, "avx", double, __m256d, _mm256_loadu_pd, _mm256_add_pd, _mm256_storeu_pd, _mm256_stream_pd,
           4)
#endif

/* A tile small enough for L1: every source is read once per tile and the destinations written from it, so a
 * destination that coincides with a source is only written after the source's tile was read. */
#define TILE_BYTES 8192

static void reduce_tiled(char *d, char *d2, const void *const *src, int ns, size_t n, t3d_dtype_t dt,
                         t3d_redop_t op, int nt2) {
  _Alignas(64) char tile[TILE_BYTES];
  size_t es = t3d_dtype_size(dt), per = TILE_BYTES / es;
  for (size_t i = 0; i < n; i += per) {
    size_t m = n - i < per ? n - i : per, off = i * es;
    memcpy(tile, (const char *)src[0] + off, m * es);
    for (int p = 1; p < ns; p++) t3d__reduce(tile, (const char *)src[p] + off, m, dt, op);
    if (d != NULL) memcpy(d + off, tile, m * es);
    if (d2 != NULL) t3d__shm_copy(d2 + off, tile, m * es, nt2);
  }
}

void t3d__shm_reduce_n(void *dst, void *dst2, const void *const *src, int nsrc, size_t n, t3d_dtype_t dt,
                       t3d_redop_t op, int nt2) {
  if (n == 0) return;
  if (nsrc == 1) {
    /* Nothing to combine: a copy (src may be dst itself). */
    size_t bytes = n * t3d_dtype_size(dt);
    if (dst == NULL) {
      if (dst2 != src[0]) t3d__shm_copy(dst2, src[0], bytes, nt2);
      return;
    }
    if (dst != src[0]) memmove(dst, src[0], bytes);
    if (dst2 != NULL && dst2 != dst) t3d__shm_copy(dst2, dst, bytes, nt2);
    return;
  }
#ifdef T3D_SHM_X86
  int v = isa();
  if (op == T3D_SUM && v != ISA_NONE && (dt == T3D_FLOAT32 || dt == T3D_FLOAT64)) {
    if (dt == T3D_FLOAT32)
      (v == ISA_AVX512 ? sum_f32_avx512 : sum_f32_avx)(dst, dst2, (const float *const *)src, nsrc, n, nt2);
    else
      (v == ISA_AVX512 ? sum_f64_avx512 : sum_f64_avx)(dst, dst2, (const double *const *)src, nsrc, n, nt2);
    return;
  }
#endif
  reduce_tiled(dst, dst2, src, nsrc, n, dt, op, nt2);
}

#ifdef T3D_SHM_X86
/* The sum written straight to every destination, whose addresses share one alignment (the scalar head reaches a
 * 64-byte boundary for all of them): with non-temporal stores when nt, else plain ones. Measured against reducing
 * into a tile and copying the tile out (2 ranks, 64 MiB allreduce on t3d memory): about 1.3x faster. Plain stores
 * are for destinations the caller has just read (in place): there a non-temporal store must first push the line
 * out of this core's cache (t3d__shm_reduce_fanout's callers). */
#define DEFINE_SUM_FANOUT(NAME, TARGET, T, V, LOAD, ADD, STORE, STREAM, LANES)                                 \
  __attribute__((target(TARGET))) static void NAME(T *const *d, int nd, const T *const *s, int ns, size_t n,    \
                                                   int nt) {                                                   \
    size_t i = 0;                                                                                              \
    for (; i < n && ((uintptr_t)(d[0] + i) & 63) != 0; i++) {                                                  \
      T acc = s[0][i];                                                                                         \
      for (int p = 1; p < ns; p++) acc += s[p][i];                                                             \
      for (int q = 0; q < nd; q++) d[q][i] = acc;                                                              \
    }                                                                                                          \
    for (; i + 4 * LANES <= n; i += 4 * LANES) {                                                               \
      V a0 = LOAD(s[0] + i), a1 = LOAD(s[0] + i + LANES);                                                      \
      V a2 = LOAD(s[0] + i + 2 * LANES), a3 = LOAD(s[0] + i + 3 * LANES);                                      \
      for (int p = 1; p < ns; p++) {                                                                           \
        const T *x = s[p] + i;                                                                                 \
        a0 = ADD(a0, LOAD(x));                                                                                 \
        a1 = ADD(a1, LOAD(x + LANES));                                                                         \
        a2 = ADD(a2, LOAD(x + 2 * LANES));                                                                     \
        a3 = ADD(a3, LOAD(x + 3 * LANES));                                                                     \
      }                                                                                                        \
      for (int q = 0; q < nd; q++) {                                                                           \
        T *y = d[q] + i;                                                                                       \
        if (nt) {                                                                                              \
          STREAM(y, a0);                                                                                       \
          STREAM(y + LANES, a1);                                                                               \
          STREAM(y + 2 * LANES, a2);                                                                           \
          STREAM(y + 3 * LANES, a3);                                                                           \
        } else {                                                                                               \
          STORE(y, a0);                                                                                        \
          STORE(y + LANES, a1);                                                                                \
          STORE(y + 2 * LANES, a2);                                                                            \
          STORE(y + 3 * LANES, a3);                                                                            \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
    for (; i < n; i++) {                                                                                       \
      T acc = s[0][i];                                                                                         \
      for (int p = 1; p < ns; p++) acc += s[p][i];                                                             \
      for (int q = 0; q < nd; q++) d[q][i] = acc;                                                              \
    }                                                                                                          \
    if (nt) _mm_sfence();                                                                                      \
  }

DEFINE_SUM_FANOUT(fanout_f32_avx512, "avx512f", float, __m512, _mm512_loadu_ps, _mm512_add_ps, _mm512_storeu_ps,
                  _mm512_stream_ps, 16)
DEFINE_SUM_FANOUT(fanout_f64_avx512, "avx512f", double, __m512d, _mm512_loadu_pd, _mm512_add_pd, _mm512_storeu_pd,
                  _mm512_stream_pd, 8)
DEFINE_SUM_FANOUT(fanout_f32_avx, "avx", float, __m256, _mm256_loadu_ps, _mm256_add_ps, _mm256_storeu_ps,
                  _mm256_stream_ps, 8)
DEFINE_SUM_FANOUT(fanout_f64_avx, "avx", double, __m256d, _mm256_loadu_pd, _mm256_add_pd, _mm256_storeu_pd,
                  _mm256_stream_pd, 4)
#endif

/* Whether every destination sits at the same place within a 64-byte line, on an element boundary. */
static int same_alignment(void *const *dst, int ndst, size_t es) {
  uintptr_t a = (uintptr_t)dst[0] & 63;
  if (a % es != 0) return 0;
  for (int q = 1; q < ndst; q++) {
    if (((uintptr_t)dst[q] & 63) != a) return 0;
  }
  return 1;
}

/* A tile that stays in L1 while it is written out to every destination. */
#define FANOUT_TILE 16384

void t3d__shm_reduce_fanout(void *const *dst, int ndst, const void *const *src, int nsrc, size_t n, t3d_dtype_t dt,
                            t3d_redop_t op, int nt) {
  _Alignas(64) char tile[FANOUT_TILE];
  const void *at[T3D_SHM_FANOUT_MAX];
  size_t es = t3d_dtype_size(dt), per = FANOUT_TILE / es;
  int v = isa();
  if (v == ISA_NONE) nt = 0; /* no vector registers: no non-temporal stores either */
#ifdef T3D_SHM_X86
  if (v != ISA_NONE && op == T3D_SUM && (dt == T3D_FLOAT32 || dt == T3D_FLOAT64) && same_alignment(dst, ndst, es)) {
    if (dt == T3D_FLOAT32)
      (v == ISA_AVX512 ? fanout_f32_avx512 : fanout_f32_avx)((float *const *)dst, ndst, (const float *const *)src,
                                                               nsrc, n, nt);
    else
      (v == ISA_AVX512 ? fanout_f64_avx512 : fanout_f64_avx)((double *const *)dst, ndst, (const double *const *)src,
                                                               nsrc, n, nt);
    return;
  }
#endif
  for (size_t i = 0; i < n; i += per) {
    size_t m = n - i < per ? n - i : per, off = i * es;
    for (int p = 0; p < nsrc; p++) at[p] = (const char *)src[p] + off;
    t3d__shm_reduce_n(tile, NULL, at, nsrc, m, dt, op, 0);
    for (int q = 0; q < ndst; q++) t3d__shm_copy((char *)dst[q] + off, tile, m * es, nt);
  }
}
