/* bfloat16 attention on AMX tiles (AMX-TILE + AMX-BF16), with AVX-512 for the softmax and the element-wise work.
 * Only this file is built with -mamx-tile -mamx-bf16 (plus the AVX-512 flags it needs); attn_cpu.c calls into it
 * only after t3d__attn_amx_usable() said yes: the CPU reports the tiles (CPUID) and Linux granted this process the
 * tile data state (arch_prctl ARCH_REQ_XCOMP_PERM), asked once.
 *
 * Every tile is used full size (16 rows x 64 bytes); operands are packed into zero-padded buffers so that no tile
 * reads past the problem: the head dimension is padded to 32 (the K of the QK^T tiles) or 16 (the N of the PV
 * tiles), key blocks to 32 keys. Products accumulate in float32; P and dS are rounded to bfloat16 for the second
 * product as flash attention does. */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "attn_cpu_internal.h"

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
/* Lazy rescaling: a row's running maximum only moves when a block's maximum exceeds it by more than this (log2
 * units), so probabilities stay below 2^8 and most blocks skip rescaling the accumulators. Exact either way: the
 * final lse and normalisation use the maximum actually applied. */
#define RESCALE_SLACK 8.0f

enum { BQ = ATTN_FWD_BQ, BK = ATTN_FWD_BK };

/* ---------------------------------------------------------------- availability */

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_ok;

static void amx_probe(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
  if (!(d & (1u << 22)) || !(d & (1u << 24))) return; /* AMX-BF16, AMX-TILE */
  /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: process wide, refused by kernels without AMX support. */
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return;
  amx_ok = 1;
}

int t3d__attn_amx_usable(void) {
  pthread_once(&amx_once, amx_probe);
  return amx_ok;
}

typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_cfg_t;

/* Tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B; all 16 rows x 64 bytes. Per thread: called at the start of every
 * task range (the threads come from the caller's pool). */
static void amx_begin(void) {
  amx_cfg_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int i = 0; i < 8; i++) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

/* ---------------------------------------------------------------- tile GEMM */

/* C (+)= A B over tiles: A bfloat16 row-major, tile (i, kk) at A + 16 i lda + 64 kk bytes; B in pair (VNNI) layout,
 * tile (kk, j) at B + 16 kk ldb + 64 j; C float32, tile (i, j) at C + 16 i ldc + 64 j. mt, nt: 16-row / 16-column
 * tiles of C, kt: 32-element steps of the inner dimension. Leading dimensions in bytes. */
#define ATILE(t, i, kk) _tile_loadd(t, a + (int64_t)(i) * 16 * lda + (int64_t)(kk) * 64, lda)
#define BTILE(t, kk, j) _tile_loadd(t, b + (int64_t)(kk) * 16 * ldb + (int64_t)(j) * 64, ldb)
#define CPTR(i, j) (c + (int64_t)(i) * 16 * ldc + (int64_t)(j) * 64)
#define CINIT(t, i, j)                 \
  do {                                 \
    if (acc)                           \
      _tile_loadd(t, CPTR(i, j), ldc); \
    else                               \
      _tile_zero(t);                   \
  } while (0)

static inline __attribute__((always_inline)) void amx_gemm(int mt, int nt, int kt, const void *A, int64_t lda, const void *B, int64_t ldb, float *C,
                     int64_t ldc, int acc) {
  const char *a = (const char *)A, *b = (const char *)B;
  char *c = (char *)C;
  int i = 0;
  for (; i + 2 <= mt; i += 2) {
    int j = 0;
    for (; j + 2 <= nt; j += 2) {
      CINIT(0, i, j);
      CINIT(1, i, j + 1);
      CINIT(2, i + 1, j);
      CINIT(3, i + 1, j + 1);
      for (int kk = 0; kk < kt; kk++) {
        ATILE(4, i, kk);
        BTILE(6, kk, j);
        _tile_dpbf16ps(0, 4, 6);
        BTILE(7, kk, j + 1);
        _tile_dpbf16ps(1, 4, 7);
        ATILE(5, i + 1, kk);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, CPTR(i, j), ldc);
      _tile_stored(1, CPTR(i, j + 1), ldc);
      _tile_stored(2, CPTR(i + 1, j), ldc);
      _tile_stored(3, CPTR(i + 1, j + 1), ldc);
    }
    if (j < nt) {
      CINIT(0, i, j);
      CINIT(2, i + 1, j);
      for (int kk = 0; kk < kt; kk++) {
        BTILE(6, kk, j);
        ATILE(4, i, kk);
        _tile_dpbf16ps(0, 4, 6);
        ATILE(5, i + 1, kk);
        _tile_dpbf16ps(2, 5, 6);
      }
      _tile_stored(0, CPTR(i, j), ldc);
      _tile_stored(2, CPTR(i + 1, j), ldc);
    }
  }
  if (i < mt) {
    int j = 0;
    for (; j + 2 <= nt; j += 2) {
      CINIT(0, i, j);
      CINIT(1, i, j + 1);
      for (int kk = 0; kk < kt; kk++) {
        ATILE(4, i, kk);
        BTILE(6, kk, j);
        _tile_dpbf16ps(0, 4, 6);
        BTILE(7, kk, j + 1);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(0, CPTR(i, j), ldc);
      _tile_stored(1, CPTR(i, j + 1), ldc);
    }
    if (j < nt) {
      CINIT(0, i, j);
      for (int kk = 0; kk < kt; kk++) {
        ATILE(4, i, kk);
        BTILE(6, kk, j);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, CPTR(i, j), ldc);
    }
  }
}

/* One out-of-line copy per use, so profiles tell the products apart. */
#define AMX_GEMM_FN(name)                                                                                          \
  static __attribute__((noipa)) void name(int mt, int nt, int kt, const void *A, int64_t lda, const void *B,        \
                                          int64_t ldb, float *C, int64_t ldc, int acc) {                            \
    amx_gemm(mt, nt, kt, A, lda, B, ldb, C, ldc, acc);                                                             \
  }
AMX_GEMM_FN(gemm_fwd_qk)
AMX_GEMM_FN(gemm_fwd_pv)
AMX_GEMM_FN(gemm_bwd_sdp)
AMX_GEMM_FN(gemm_bwd_kv)
AMX_GEMM_FN(gemm_bwd_dq)

/* ---------------------------------------------------------------- AVX-512 helpers */

static inline __mmask16 mask16(int64_t r) {
  return r >= 16 ? (__mmask16)0xffff : r <= 0 ? (__mmask16)0 : (__mmask16)((1u << r) - 1u);
}

/* 2^x for finite x <= ~8 (callers subtract the row maximum): x = n + f, |f| <= 1/2, 2^f by its degree-5 Taylor
 * polynomial (relative error < 3e-6, far below bfloat16's 4e-3), then scalef, which flushes very negative x to 0.
 * Lanes the callers mask off may compute inf or NaN; they are discarded. */
static inline __m512 exp2_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

static inline float row_max(const float *x, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + j));
  if (j < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask16(n - j), x + j));
  return _mm512_reduce_max_ps(m);
}

/* dst[0..n) = bfloat16(x[0..n) * mul) (round to nearest even), for float32 rows without NaN. */
static inline void store_bf16_row(uint16_t *dst, const float *x, int64_t n, float mul) {
  const __m512 vm = _mm512_set1_ps(mul);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = mask16(n - j);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, x + j), vm);
    _mm256_mask_storeu_epi16(dst + j, mk, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

/* ---------------------------------------------------------------- forward */

static inline int64_t pad32(int64_t x) { return (x + 31) & ~(int64_t)31; }
static inline int64_t pad16(int64_t x) { return (x + 15) & ~(int64_t)15; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Packed key block: K^T in pairs, (DP / 2) rows of LDKW words (word (p, j) = K[j][2p], K[j][2p + 1]), then V in
 * pairs, (BK / 2) rows of LDVW words (word (j2, d) = V[2 j2][d], V[2 j2 + 1][d]); zero past the keys and D. Row
 * strides padded off multiples of 512 bytes. */
#define LDKW ((int64_t)BK + 16)
static inline int64_t ldvw(int64_t D) { return pad16(D) + 16; }
static inline int64_t kwords(int64_t D) { return pad32(D) / 2 * LDKW; }

int64_t t3d__attn_amx_fwd_block_bytes(int64_t D) { return 4 * (kwords(D) + (BK / 2) * ldvw(D)); }

/* dst[c * ldd + r] = src[r * lds + c] for a 16 x 16 block of 32-bit words. */
static inline void transpose16_u32(const uint32_t *src, int64_t lds, uint32_t *dst, int64_t ldd) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  /* u[4g + k], lane L = column 4L + k of rows 4g .. 4g + 3 */
  for (int g = 0; g < 4; g++) {
    const __m512i a = t[4 * g], b = t[4 * g + 1], c = t[4 * g + 2], d = t[4 * g + 3];
    r[4 * g] = _mm512_unpacklo_epi64(a, c);
    r[4 * g + 1] = _mm512_unpackhi_epi64(a, c);
    r[4 * g + 2] = _mm512_unpacklo_epi64(b, d);
    r[4 * g + 3] = _mm512_unpackhi_epi64(b, d);
  }
  for (int k = 0; k < 4; k++) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), x1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xee);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xee);
    _mm512_storeu_si512(dst + k * ldd, _mm512_shuffle_i32x4(x0, y0, 0x88));
    _mm512_storeu_si512(dst + (4 + k) * ldd, _mm512_shuffle_i32x4(x0, y0, 0xdd));
    _mm512_storeu_si512(dst + (8 + k) * ldd, _mm512_shuffle_i32x4(x1, y1, 0x88));
    _mm512_storeu_si512(dst + (12 + k) * ldd, _mm512_shuffle_i32x4(x1, y1, 0xdd));
  }
}

/* K^T (or V^T) in pairs along D: dst[pp * ldw + j] = (src[j][2 pp], src[j][2 pp + 1]) for keys j < nk, zero for
 * nk <= j < ncols and for pairs past D; (pad32(D) / 2) rows. src: nk rows of D bfloat16. 16 x 16 word blocks go
 * through the vector transpose. */
static void pack_pairs_t(const uint16_t *src, int64_t D, int64_t nk, uint32_t *dst, int64_t ldw, int64_t ncols) {
  const int64_t DP = pad32(D);
  int64_t jv = 0; /* keys [0, jv) done by the vector transpose */
  if (D % 32 == 0) {
    for (; jv + 16 <= nk; jv += 16)
      for (int64_t p0 = 0; p0 < D / 2; p0 += 16)
        transpose16_u32((const uint32_t *)(const void *)(src + jv * D) + p0, D / 2, dst + p0 * ldw + jv, ldw);
  }
  for (int64_t pp = 0; pp < DP / 2; pp++) {
    uint32_t *row = dst + pp * ldw;
    const int64_t d0 = 2 * pp;
    if (d0 + 1 < D) {
      for (int64_t j = jv; j < nk; j++) memcpy(row + j, src + j * D + d0, 4);
    } else if (d0 < D) {
      for (int64_t j = jv; j < nk; j++) row[j] = src[j * D + d0];
    } else {
      memset(row + jv, 0, 4 * (size_t)(nk - jv));
    }
    memset(row + nk, 0, 4 * (size_t)(ncols - nk));
  }
}

static void pack_block(const t3d__attn_problem *p, int64_t r0, int64_t nk, uint32_t *Kp, uint32_t *Vp) {
  const int64_t D = p->D, DO = pad16(D), LV = ldvw(D);
  const uint16_t *ks = (const uint16_t *)p->k + r0 * D, *vs = (const uint16_t *)p->v + r0 * D;
  pack_pairs_t(ks, D, nk, Kp, LDKW, BK);
  for (int64_t j2 = 0; j2 < BK / 2; j2++) {
    uint32_t *dst = Vp + j2 * LV;
    const int64_t j = 2 * j2;
    if (j + 1 < nk) {
      const uint16_t *x = vs + j * D, *y = x + D;
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        const __m256i xa = _mm256_loadu_si256((const __m256i *)(x + d));
        const __m256i ya = _mm256_loadu_si256((const __m256i *)(y + d));
        const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(xa),
                                          _mm512_slli_epi32(_mm512_cvtepu16_epi32(ya), 16));
        _mm512_storeu_si512(dst + d, w);
      }
      for (; d < D; d++) dst[d] = (uint32_t)x[d] | ((uint32_t)y[d] << 16);
    } else if (j < nk) {
      for (int64_t d = 0; d < D; d++) dst[d] = vs[j * D + d];
    } else {
      memset(dst, 0, 4 * (size_t)D);
    }
    memset(dst + D, 0, 4 * (size_t)(DO - D));
  }
}

void t3d__attn_amx_fwd_pack(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch) {
  (void)scratch;
  for (int64_t t = begin; t < end; t++) {
    const int64_t unit = t / p->nkb, kb = t % p->nkb;
    const int64_t k0 = kb * BK, nk = min64(BK, p->Sk - k0);
    uint32_t *blk = (uint32_t *)(p->kvpack + t * p->kvpack_bytes);
    pack_block(p, unit * p->Sk + k0, nk, blk, blk + kwords(p->D));
  }
}

/* P[j] = bfloat16(2^(c S[j] - m)) for j < vis, 0 for vis <= j < n32; returns the sum of the float32 values and
 * the largest S[j], j < vis, in *smax. */
static inline float exp_row(const float *S, int64_t vis, int64_t n32, float c, float m, uint16_t *P, float *smax) {
  const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps(), mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n32; j += 32) {
    const __mmask16 k0 = mask16(vis - j), k1 = mask16(vis - j - 16);
    const __m512 s0 = _mm512_maskz_loadu_ps(k0, S + j), s1 = _mm512_maskz_loadu_ps(k1, S + j + 16);
    mx = _mm512_mask_max_ps(mx, k0, mx, s0);
    mx = _mm512_mask_max_ps(mx, k1, mx, s1);
    const __m512 e0 = _mm512_maskz_mov_ps(k0, exp2_ps(_mm512_fmsub_ps(vc, s0, vm)));
    const __m512 e1 = _mm512_maskz_mov_ps(k1, exp2_ps(_mm512_fmsub_ps(vc, s1, vm)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    _mm512_storeu_si512(P + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  *smax = _mm512_reduce_max_ps(mx);
  return _mm512_reduce_add_ps(sum);
}

/* Softmax of one score row against the running state (m2: maximum applied so far, log2 units; l: sum), written to
 * P as bfloat16: columns [0, vis) are visible, [vis, n32) become zeros. One pass with the running maximum when the
 * row's new scores stay within RESCALE_SLACK of it; otherwise (and on the row's first block) the maximum moves, the
 * accumulator row O (DO floats) and l are rescaled, and the pass is redone. */
static inline void softmax_row(const float *S, int64_t vis, int64_t n32, float c, float *m2, float *l, float *O,
                               int64_t DO, uint16_t *P) {
  if (vis <= 0) {
    memset(P, 0, 2 * (size_t)n32);
    return;
  }
  float smax;
  if (*m2 != -INFINITY) {
    const float sum = exp_row(S, vis, n32, c, *m2, P, &smax);
    if (!(smax * c > *m2 + RESCALE_SLACK)) {
      *l += sum;
      return;
    }
  } else {
    smax = row_max(S, vis);
  }
  const float mx = smax * c;
  const float alpha = exp2f(*m2 - mx); /* 0 the first time (m2 = -inf) */
  *l *= alpha;
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t d = 0; d < DO; d += 16) _mm512_storeu_ps(O + d, _mm512_mul_ps(_mm512_loadu_ps(O + d), va));
  *m2 = mx;
  *l += exp_row(S, vis, n32, c, mx, P, &smax);
}

void t3d__attn_amx_fwd(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch) {
  const int64_t D = p->D, DP = pad32(D), DO = pad16(D), LV = ldvw(D);
  const int64_t LDS = BK + 16, LDP = BK + 32, LDO = DO + 16;
  const float c = p->scale * LOG2E;

  uint16_t *Qb = (uint16_t *)scratch;                 /* BQ x DP */
  float *S = (float *)(Qb + BQ * ATTN_DMAX);           /* BQ x LDS */
  uint16_t *Pb = (uint16_t *)(S + BQ * LDS);           /* BQ x LDP */
  float *O = (float *)(Pb + BQ * LDP);                 /* BQ x LDO */
  float *m2 = O + BQ * (ATTN_DMAX + 16);
  float *l = m2 + BQ;
  uint32_t *Kp = (uint32_t *)(l + BQ);                 /* own packing when there is no shared one */
  uint32_t *Vp = Kp + kwords(ATTN_DMAX);

  amx_begin();
  for (int64_t t = begin; t < end; t++) {
    const int64_t bh = t / p->nqb, z = t % p->nqb;
    const int64_t qb = (z & 1) ? p->nqb - 1 - z / 2 : z / 2;
    const int64_t b = bh / p->Hq, h = bh % p->Hq, kvh = h / p->group;
    const int64_t q0 = qb * BQ, mq = min64(BQ, p->Sq - q0), mq16 = pad16(mq);
    const int64_t qrow0 = bh * p->Sq + q0;
    const int64_t unit = b * p->Hkv + kvh;
    int64_t kend = p->Sk;
    if (p->causal) kend = max64(0, min64(p->Sk, p->q_start + q0 + mq - p->k_start));

    const uint16_t *qs = (const uint16_t *)p->q + qrow0 * D;
    for (int64_t i = 0; i < mq16; i++) {
      uint16_t *dst = Qb + i * DP;
      if (i < mq) {
        memcpy(dst, qs + i * D, 2 * (size_t)D);
        memset(dst + D, 0, 2 * (size_t)(DP - D));
      } else {
        memset(dst, 0, 2 * (size_t)DP);
        memset(Pb + i * LDP, 0, 2 * (size_t)BK);
      }
      memset(O + i * LDO, 0, 4 * (size_t)DO);
      m2[i] = -INFINITY;
      l[i] = 0.0f;
    }

    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
      const int64_t nkv = min64(BK, kend - k0), n32 = pad32(nkv);
      const uint32_t *Kb = Kp, *Vb = Vp;
      if (p->kvpack) {
        Kb = (const uint32_t *)(p->kvpack + (unit * p->nkb + k0 / BK) * p->kvpack_bytes);
        Vb = Kb + kwords(D);
      } else {
        pack_block(p, unit * p->Sk + k0, min64(BK, p->Sk - k0), Kp, Vp);
      }
      gemm_fwd_qk((int)(mq16 / 16), (int)(pad16(nkv) / 16), (int)(DP / 32), Qb, 2 * DP, Kb, 4 * LDKW, S, 4 * LDS, 0);
      const int64_t diag = p->q_start + q0 - (p->k_start + k0) + 1; /* keys row 0 sees, when causal */
      for (int64_t i = 0; i < mq; i++) {
        const int64_t vis = p->causal ? min64(nkv, diag + i) : nkv;
        softmax_row(S + i * LDS, vis, n32, c, m2 + i, l + i, O + i * LDO, DO, Pb + i * LDP);
      }
      gemm_fwd_pv((int)(mq16 / 16), (int)(DO / 16), (int)(n32 / 32), Pb, 2 * LDP, Vb, 4 * LV, O, 4 * LDO, 1);
    }

    for (int64_t i = 0; i < mq; i++) {
      uint16_t *dst = (uint16_t *)p->out + (qrow0 + i) * D;
      if (l[i] > 0.0f) {
        store_bf16_row(dst, O + i * LDO, D, 1.0f / l[i]);
        p->lse[qrow0 + i] = (m2[i] + log2f(l[i])) * LN2;
      } else {
        memset(dst, 0, 2 * (size_t)D);
        p->lse[qrow0 + i] = -INFINITY;
      }
    }
  }
  _tile_release();
}

/* ---------------------------------------------------------------- backward */

/* Per (batch, q head), written by the pre-pass: Q and dO zero-padded to [SQP x DP] (A of S = Q K^T and dP = dO V^T),
 * and transposed, [DO x LQT] (A of dK^T = Q^T dS and dV^T = dO^T P). SQP = Sq rounded up to the query block. */
/* The backward walks the queries BQB at a time (S and dP stay in L1) and runs the dK^T / dV^T products once per
 * QCH queries, so their accumulator tiles are loaded and stored once per 16 tile steps. */
enum { BQB = 64, BKB = ATTN_BWD_BK, QCH = 512 };
static inline int64_t bwd_sqp(const t3d__attn_problem *p) { return (p->Sq + BQB - 1) / BQB * BQB; }
/* Row stride of the transposed packs: 64 bytes past the padded length, so the 16 rows of a tile do not land in one
 * L1 set when SQP is a multiple of 2048. */
static inline int64_t bwd_lqt(const t3d__attn_problem *p) { return bwd_sqp(p) + 32; }

int64_t t3d__attn_amx_bwd_qbytes(const t3d__attn_problem *p) {
  return 2 * (bwd_sqp(p) * 2 * pad32(p->D) + bwd_lqt(p) * 2 * pad16(p->D));
}

void t3d__attn_amx_bwd_pack(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch) {
  (void)scratch;
  const int64_t D = p->D, DP = pad32(D), DO = pad16(D), SQP = bwd_sqp(p), LQT = bwd_lqt(p), Sq = p->Sq;
  for (int64_t bh = begin; bh < end; bh++) {
    uint16_t *Qp = (uint16_t *)(p->bwd_qpack + bh * p->bwd_qpack_bytes);
    uint16_t *dOp = Qp + SQP * DP, *QT = dOp + SQP * DP, *dOT = QT + DO * LQT;
    const uint16_t *srcs[2] = {(const uint16_t *)p->q + bh * Sq * D, (const uint16_t *)p->dout + bh * Sq * D};
    uint16_t *rows[2] = {Qp, dOp}, *cols[2] = {QT, dOT};
    for (int w = 0; w < 2; w++) {
      const uint16_t *src = srcs[w];
      for (int64_t i = 0; i < SQP; i++) {
        uint16_t *dst = rows[w] + i * DP;
        if (i < Sq) {
          memcpy(dst, src + i * D, 2 * (size_t)D);
          memset(dst + D, 0, 2 * (size_t)(DP - D));
        } else {
          memset(dst, 0, 2 * (size_t)DP);
        }
      }
      uint16_t *T = cols[w];
      memset(T, 0, 2 * (size_t)(DO * LQT));
      for (int64_t i0 = 0; i0 < Sq; i0 += 32) {
        const int64_t ni = min64(32, Sq - i0);
        for (int64_t d = 0; d < D; d++) {
          uint16_t *dst = T + d * LQT + i0;
          for (int64_t i = 0; i < ni; i++) dst[i] = src[(i0 + i) * D + d];
        }
      }
    }
  }
}

#define LDKB ((int64_t)BKB + 16) /* words per row of the K^T / V^T pair packs, floats per row of S, dP, dK^T, dV^T */

/* Key-side packs of one key block (nk keys from row r0): K^T and V^T in pairs along D ([DP / 2] rows of LDKB
 * words), and K in pairs along the keys ([BKB / 2] rows of ldvw(D) words); zero padded. */
static void bwd_pack_keys(const t3d__attn_problem *p, int64_t r0, int64_t nk, uint32_t *KT, uint32_t *VT,
                          uint32_t *Kk) {
  const int64_t D = p->D, DO = pad16(D), LV = ldvw(D);
  const uint16_t *srcs[2] = {(const uint16_t *)p->k + r0 * D, (const uint16_t *)p->v + r0 * D};
  uint32_t *dsts[2] = {KT, VT};
  for (int w = 0; w < 2; w++) pack_pairs_t(srcs[w], D, nk, dsts[w], LDKB, BKB);
  const uint16_t *ks = srcs[0];
  for (int64_t j2 = 0; j2 < BKB / 2; j2++) {
    uint32_t *dst = Kk + j2 * LV;
    const int64_t j = 2 * j2;
    for (int64_t d = 0; d < D; d++) {
      const uint32_t lo = j < nk ? ks[j * D + d] : 0, hi = j + 1 < nk ? ks[(j + 1) * D + d] : 0;
      dst[d] = lo | (hi << 16);
    }
    for (int64_t d = D; d < DO; d++) dst[d] = 0;
  }
}

/* Interleaves the bfloat16 roundings of two rows: word j = (a[j], b[j]). */
static inline __m512i pair_bf16(__m512 a, __m512 b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

void t3d__attn_amx_bwd(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch) {
  const int64_t D = p->D, DP = pad32(D), DO = pad16(D), LV = ldvw(D), SQP = bwd_sqp(p), LQT = bwd_lqt(p);
  const int64_t LDSB = BKB + 32; /* bfloat16 per row of dS */
  const float c = p->scale * LOG2E;

  uint32_t *KT = (uint32_t *)scratch;     /* DP/2 x LDKB */
  uint32_t *VT = KT + ATTN_DMAX / 2 * LDKB; /* DP/2 x LDKB */
  uint32_t *Kk = VT + ATTN_DMAX / 2 * LDKB; /* BKB/2 x LV */
  float *S = (float *)(Kk + BKB / 2 * (ATTN_DMAX + 32)); /* BQB x LDKB */
  float *dP = S + BQB * LDKB;                            /* BQB x LDKB */
  uint16_t *dSb = (uint16_t *)(dP + BQB * LDKB);         /* BQB x LDSB */
  uint32_t *Pw = (uint32_t *)(dSb + BQB * LDSB);         /* QCH/2 x LDKB */
  uint32_t *dSw = Pw + QCH / 2 * LDKB;                   /* QCH/2 x LDKB */
  float *dKt = (float *)(dSw + QCH / 2 * LDKB);          /* DO x LDKB */
  float *dVt = dKt + (ATTN_DMAX + 16) * LDKB;            /* DO x LDKB */
  float *dQ = dVt + (ATTN_DMAX + 16) * LDKB;             /* BQB x (DO + 16) */
  const int64_t LDQ = DO + 16;

  const int64_t nrows_q = p->B * p->Hq * p->Sq;
  amx_begin();
  for (int64_t t = begin; t < end; t++) {
    const int64_t unit = t / p->slabs, s = t % p->slabs;
    const int64_t b = unit / p->Hkv, kvh = unit % p->Hkv;
    const int64_t krow0 = unit * p->Sk;
    float *dq_acc = p->dq_acc + s * nrows_q * D;

    for (int64_t kb = s; kb < p->nkb; kb += p->slabs) {
      const int64_t k0 = kb * BKB, nk = min64(BKB, p->Sk - k0), nk16 = pad16(nk), nk32 = pad32(nk);
      bwd_pack_keys(p, krow0 + k0, nk, KT, VT, Kk);
      memset(dKt, 0, 4 * (size_t)(DO * LDKB));
      memset(dVt, 0, 4 * (size_t)(DO * LDKB));

      int64_t qfirst = 0;
      if (p->causal) qfirst = max64(0, p->k_start + k0 - p->q_start);
      for (int64_t hh = 0; hh < p->group && qfirst < p->Sq; hh++) {
        const int64_t bh = b * p->Hq + kvh * p->group + hh;
        const int64_t rowbase = bh * p->Sq;
        const uint16_t *Qp = (const uint16_t *)(p->bwd_qpack + bh * p->bwd_qpack_bytes);
        const uint16_t *dOp = Qp + SQP * DP, *QT = dOp + SQP * DP, *dOT = QT + DO * LQT;
        const int64_t qlo = (qfirst / BQB) * BQB;
        for (int64_t q0 = qlo; q0 < p->Sq; q0 += BQB) {
          const int64_t mq = min64(BQB, p->Sq - q0), mq16 = pad16(mq), mq32 = pad32(mq);
          const int64_t cs = qlo + (q0 - qlo) / QCH * QCH; /* this chunk's first query */
          uint32_t *Pwq = Pw + (q0 - cs) / 2 * LDKB, *dSwq = dSw + (q0 - cs) / 2 * LDKB;
          gemm_bwd_sdp((int)(mq16 / 16), (int)(nk16 / 16), (int)(DP / 32), Qp + q0 * DP, 2 * DP, KT, 4 * LDKB, S,
                   4 * LDKB, 0);
          gemm_bwd_sdp((int)(mq16 / 16), (int)(nk16 / 16), (int)(DP / 32), dOp + q0 * DP, 2 * DP, VT, 4 * LDKB, dP,
                   4 * LDKB, 0);
          /* P = exp(scale S - lse), dS = P (dP - delta), rows in pairs; rows past mq and keys past the visible
           * ones are zeros. */
          const int64_t diag = p->q_start + q0 - (p->k_start + k0) + 1;
          for (int64_t i = 0; i < mq32; i += 2) {
            __m512 pr[2][BKB / 16], dr[2][BKB / 16];
            for (int r = 0; r < 2; r++) {
              const int64_t ii = i + r;
              float L = -INFINITY, Di = 0.0f;
              if (ii < mq) {
                L = p->lse_in[rowbase + q0 + ii];
                Di = p->delta[rowbase + q0 + ii];
              }
              int64_t vis = p->causal ? min64(nk, diag + ii) : nk;
              if (ii >= mq || L == -INFINITY || L != L) vis = 0;
              const __m512 vc = _mm512_set1_ps(c), vl = _mm512_set1_ps(L * LOG2E), vd = _mm512_set1_ps(Di);
              for (int v = 0; v < BKB / 16; v++) {
                const int64_t j = 16 * v;
                const __mmask16 mk = mask16(vis - j);
                if (j >= nk32) break;
                const __m512 sv = _mm512_maskz_loadu_ps(mk, S + ii * LDKB + j);
                const __m512 pv = _mm512_maskz_mov_ps(mk, exp2_ps(_mm512_fmsub_ps(vc, sv, vl)));
                const __m512 dpv = _mm512_maskz_loadu_ps(mk, dP + ii * LDKB + j);
                pr[r][v] = pv;
                dr[r][v] = _mm512_mul_ps(pv, _mm512_sub_ps(dpv, vd));
              }
            }
            for (int v = 0; v < BKB / 16 && 16 * v < nk32; v++) {
              const int64_t j = 16 * v;
              _mm512_storeu_si512(Pwq + (i / 2) * LDKB + j, pair_bf16(pr[0][v], pr[1][v]));
              _mm512_storeu_si512(dSwq + (i / 2) * LDKB + j, pair_bf16(dr[0][v], dr[1][v]));
              _mm256_storeu_si256((__m256i *)(dSb + i * LDSB + j), (__m256i)_mm512_cvtneps_pbh(dr[0][v]));
              _mm256_storeu_si256((__m256i *)(dSb + (i + 1) * LDSB + j), (__m256i)_mm512_cvtneps_pbh(dr[1][v]));
            }
          }
          /* dQ += dS K into this slab's accumulator: straight into its rows when whole tiles fit them, else
           * through scratch. */
          float *dq_rows = dq_acc + (rowbase + q0) * D;
          if (mq == mq16 && D == DO) {
            gemm_bwd_dq((int)(mq16 / 16), (int)(DO / 16), (int)(nk32 / 32), dSb, 2 * LDSB, Kk, 4 * LV, dq_rows, 4 * D,
                     1);
          } else {
            gemm_bwd_dq((int)(mq16 / 16), (int)(DO / 16), (int)(nk32 / 32), dSb, 2 * LDSB, Kk, 4 * LV, dQ, 4 * LDQ,
                     0);
            for (int64_t i = 0; i < mq; i++) {
              float *acc = dq_rows + i * D;
              const float *x = dQ + i * LDQ;
              for (int64_t d = 0; d < D; d += 16) {
                const __mmask16 mk = mask16(D - d);
                _mm512_mask_storeu_ps(acc + d, mk, _mm512_add_ps(_mm512_maskz_loadu_ps(mk, acc + d),
                                                                 _mm512_maskz_loadu_ps(mk, x + d)));
              }
            }
          }
          /* End of a chunk: dV^T += dO^T P, dK^T += Q^T dS (unscaled) over its queries (zero rows pad the last
           * block to 32). */
          if (q0 + BQB >= p->Sq || q0 + BQB - cs >= QCH) {
            const int kt = (int)((q0 - cs + mq32) / 32);
            gemm_bwd_kv((int)(DO / 16), (int)(nk16 / 16), kt, dOT + cs, 2 * LQT, Pw, 4 * LDKB, dVt, 4 * LDKB, 1);
            gemm_bwd_kv((int)(DO / 16), (int)(nk16 / 16), kt, QT + cs, 2 * LQT, dSw, 4 * LDKB, dKt, 4 * LDKB, 1);
          }
        }
      }
      /* dK = scale dK^T^T, dV = dV^T^T, in bfloat16. */
      for (int64_t j = 0; j < nk; j++) {
        uint16_t *dk = (uint16_t *)p->dk + (krow0 + k0 + j) * D, *dv = (uint16_t *)p->dv + (krow0 + k0 + j) * D;
        for (int64_t d = 0; d < D; d++) {
          dk[d] = t3d__f32_to_bf16(dKt[d * LDKB + j] * p->scale);
          dv[d] = t3d__f32_to_bf16(dVt[d * LDKB + j]);
        }
      }
    }
  }
  _tile_release();
}
