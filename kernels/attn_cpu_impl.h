/* The tiled forward and backward drivers, compiled once per ISA: the including file defines ATTN_SUFFIX(name),
 * ATTN_HAS_BF16DOT and the microkernels mk_gemm, mk_rowmax, mk_exp2_row (and mk_gemm_bf16 when ATTN_HAS_BF16DOT),
 * then includes this header. Everything here is static so each ISA gets its own copy, vectorised for its flags.
 *
 * Microkernel contracts (row-major, leading dimensions in elements):
 *   mk_gemm(m, n, k, A, lda, B, ldb, C, ldc, acc): C[m x n] (+)= A[m x k] B[k x n], float32.
 *   mk_gemm_at(m, n, k, A, lda, ...) (optional, announced by ATTN_HAS_GEMM_AT): the same with A stored transposed,
 *     [k x m]; without it the backward transposes P and dS first.
 *   mk_gemm_bf16(m, n, kp, A, lda, B, ldb, C, ldc, acc): the same with A bfloat16 [m x 2kp] and B bfloat16 packed in
 *     pairs, B[(p * ldb + j) * 2 + e] = B_logical[2p + e][j], so one 32-bit lane holds the pair vdpbf16ps multiplies.
 *   mk_rowmax(x, n): max of x[0..n), -inf for n == 0 or all -inf.
 *   mk_exp2_row(x, n, c, sub): x[j] = 2^(c x[j] - sub) in place (0 where x[j] = -inf), returns the sum.
 *   mk_cvt_bf16_row(src, n, dst) (with ATTN_HAS_BF16DOT): dst = bfloat16(src), plus a zero at dst[n] if n is odd. */
#include "attn_cpu_internal.h"

#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f
#define ATTN_RESCALE_SLACK 8.0f

static inline int64_t ATTN_SUFFIX(min64)(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t ATTN_SUFFIX(max64)(int64_t a, int64_t b) { return a > b ? a : b; }

/* Rows [r0, r0 + nr) of a [*, D] tensor in dtype as float32 [nr, D]; returns the source itself when it is float32. */
static const float *ATTN_SUFFIX(rows_f32)(const t3d__attn_problem *p, const void *base, int64_t r0, int64_t nr,
                                         float *dst) {
  const int64_t D = p->D;
  if (p->dtype == T3D_ATTN_FLOAT32) return (const float *)base + r0 * D;
  const uint16_t *src = (const uint16_t *)base + r0 * D;
  for (int64_t i = 0; i < nr * D; i++) dst[i] = t3d__bf16_to_f32(src[i]);
  return dst;
}

/* Kt[d * ldt + j] = rows[j][d] for j < nk, as float32. */
static void ATTN_SUFFIX(pack_t_f32)(const t3d__attn_problem *p, const void *base, int64_t r0, int64_t nk,
                                    float *Kt, int64_t ldt) {
  const int64_t D = p->D;
  if (p->dtype == T3D_ATTN_FLOAT32) {
    const float *src = (const float *)base + r0 * D;
    for (int64_t j = 0; j < nk; j++)
      for (int64_t d = 0; d < D; d++) Kt[d * ldt + j] = src[j * D + d];
  } else {
    const uint16_t *src = (const uint16_t *)base + r0 * D;
    for (int64_t j = 0; j < nk; j++)
      for (int64_t d = 0; d < D; d++) Kt[d * ldt + j] = t3d__bf16_to_f32(src[j * D + d]);
  }
}

static void ATTN_SUFFIX(store_row)(const t3d__attn_problem *p, void *base, int64_t row, const float *x, float mul) {
  const int64_t D = p->D;
  if (p->dtype == T3D_ATTN_FLOAT32) {
    float *dst = (float *)base + row * D;
    for (int64_t d = 0; d < D; d++) dst[d] = x[d] * mul;
  } else {
    uint16_t *dst = (uint16_t *)base + row * D;
    for (int64_t d = 0; d < D; d++) dst[d] = t3d__f32_to_bf16(x[d] * mul);
  }
}

/* Causal: in a tile whose first query is q0 and first key k0, query i sees the first vis(i) keys of the tile. Keys
 * past that are set to -inf so the exponential turns them into exact zeros. */
static void ATTN_SUFFIX(mask_tile)(const t3d__attn_problem *p, float *S, int64_t lds, int64_t q0, int64_t mq,
                                   int64_t k0, int64_t nk) {
  for (int64_t i = 0; i < mq; i++) {
    int64_t vis = p->q_start + q0 + i - (p->k_start + k0) + 1;
    if (vis >= nk) break; /* later rows see even more */
    for (int64_t j = ATTN_SUFFIX(max64)(vis, 0); j < nk; j++) S[i * lds + j] = -INFINITY;
  }
}

/* float32 V is read in place by the PV product unless its rows are a multiple of 512 bytes apart (then the rows of a
 * panel would crowd a few L1 sets, and the packed copy with its padded stride is used). */
static inline int ATTN_SUFFIX(v_direct)(const t3d__attn_problem *p) {
  return p->dtype == T3D_ATTN_FLOAT32 && (p->D % 128) != 0;
}

/* Packs keys [r0, r0 + nk) of K and V (rows of the [*, D] tensors) for the forward GEMMs: Kdst gets K^T with leading
 * dimension LDK, Vdst V with leading dimension LDV; with dot16 both hold bfloat16 pairs (K^T paired along D, V along
 * the keys, zero-padded), otherwise float32. */
static void ATTN_SUFFIX(fwd_pack_block)(const t3d__attn_problem *p, int dot16, int64_t r0, int64_t nk, void *Kdst,
                                        void *Vdst) {
  const int64_t D = p->D, LDK = ATTN_FWD_LDK(D), LDV = ATTN_FWD_LDV(D);
  if (dot16) {
    /* K^T pairs: 32-bit lane (d2, j) = K[j][2 d2 .. 2 d2 + 1]. */
    const uint16_t *src = (const uint16_t *)p->k + r0 * D;
    uint32_t *Kp = (uint32_t *)Kdst;
    for (int64_t j0 = 0; j0 < nk; j0 += 16) {
      const int64_t jn = ATTN_SUFFIX(min64)(16, nk - j0);
      for (int64_t d2 = 0; d2 < D / 2; d2++) {
        uint32_t *dst = Kp + d2 * LDK + j0;
        for (int64_t j = 0; j < jn; j++) memcpy(dst + j, src + (j0 + j) * D + 2 * d2, sizeof(uint32_t));
      }
    }
    if (D & 1)
      for (int64_t j = 0; j < nk; j++) Kp[(D / 2) * LDK + j] = src[j * D + D - 1]; /* high half 0 (little endian) */
    /* V pairs: 32-bit lane (j2, d) = (V[2 j2][d], V[2 j2 + 1][d]). */
    const uint16_t *vs = (const uint16_t *)p->v + r0 * D;
    uint16_t *Vp = (uint16_t *)Vdst;
    const int64_t nkp = (nk + 1) / 2;
    for (int64_t j2 = 0; j2 < nkp; j2++) {
      const uint16_t *a = vs + (2 * j2) * D;
      uint16_t *dst = Vp + j2 * LDV * 2;
      if (2 * j2 + 1 < nk) {
        const uint16_t *b2 = a + D;
        for (int64_t d = 0; d < D; d++) {
          dst[2 * d] = a[d];
          dst[2 * d + 1] = b2[d];
        }
      } else {
        for (int64_t d = 0; d < D; d++) {
          dst[2 * d] = a[d];
          dst[2 * d + 1] = 0;
        }
      }
    }
    return;
  }
  float *Kt = (float *)Kdst, *Vf = (float *)Vdst;
  if (p->dtype == T3D_ATTN_FLOAT32) {
    /* Transpose in 16-key strips so the reads of a strip stay in L1 while its columns are written. */
    const float *src = (const float *)p->k + r0 * D;
    for (int64_t j0 = 0; j0 < nk; j0 += 16) {
      const int64_t jn = ATTN_SUFFIX(min64)(16, nk - j0);
      for (int64_t d = 0; d < D; d++) {
        float *dst = Kt + d * LDK + j0;
        for (int64_t j = 0; j < jn; j++) dst[j] = src[(j0 + j) * D + d];
      }
    }
    if (ATTN_SUFFIX(v_direct)(p)) return;
    const float *vs = (const float *)p->v + r0 * D;
    for (int64_t j = 0; j < nk; j++) memcpy(Vf + j * LDV, vs + j * D, sizeof(float) * (size_t)D);
  } else {
    ATTN_SUFFIX(pack_t_f32)(p, p->k, r0, nk, Kt, LDK);
    const uint16_t *vs = (const uint16_t *)p->v + r0 * D;
    for (int64_t j = 0; j < nk; j++)
      for (int64_t d = 0; d < D; d++) Vf[j * LDV + d] = t3d__bf16_to_f32(vs[j * D + d]);
  }
}

/* Forward pre-pass: key blocks [begin, end), indexed (b * Hkv + kvh) * nkb + kb, into p->kvpack. */
static void ATTN_SUFFIX(fwd_pack)(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch) {
  (void)scratch;
  const int dot16 = ATTN_HAS_BF16DOT && p->dtype == T3D_ATTN_BFLOAT16 && p->use_bf16dot;
  const int64_t kbytes = t3d__attn_fwd_kbytes(p->D, dot16);
  for (int64_t t = begin; t < end; t++) {
    const int64_t unit = t / p->nkb, kb = t % p->nkb;
    const int64_t k0 = kb * ATTN_FWD_BK, nk = ATTN_SUFFIX(min64)(ATTN_FWD_BK, p->Sk - k0);
    unsigned char *blk = p->kvpack + t * p->kvpack_bytes;
    ATTN_SUFFIX(fwd_pack_block)(p, dot16, unit * p->Sk + k0, nk, blk, blk + kbytes);
  }
}

static void ATTN_SUFFIX(fwd)(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch) {
  enum { BQ = ATTN_FWD_BQ, BK = ATTN_FWD_BK };
  const int64_t D = p->D;
  const int bf = p->dtype == T3D_ATTN_BFLOAT16;
  const int dot16 = ATTN_HAS_BF16DOT && bf && p->use_bf16dot;
  const int64_t Dp = (D + 1) & ~(int64_t)1;
  const float c = p->scale * ATTN_LOG2E;
  const int64_t LDK = ATTN_FWD_LDK(D), LDV = ATTN_FWD_LDV(D);
  const int64_t kbytes = t3d__attn_fwd_kbytes(D, dot16);

  float *Qf = (float *)scratch;            /* BQ x DMAX */
  float *Kt = Qf + BQ * ATTN_DMAX;          /* DMAX x LDK */
  float *Vf = Kt + ATTN_DMAX * (BK + 16);   /* BK x (DMAX + 16) */
  float *S = Vf + BK * (ATTN_DMAX + 16);    /* BQ x BK */
  uint16_t *Pb = (uint16_t *)(S + BQ * BK); /* BQ x BK bf16 */
  float *O = S + 2 * BQ * BK;      /* BQ x DMAX */
  float *m2 = O + BQ * ATTN_DMAX;  /* running max, log2 domain */
  float *l = m2 + BQ;
  (void)Pb;
  (void)dot16;
  (void)Dp;

  for (int64_t t = begin; t < end; t++) {
    /* Alternate early and late query blocks so any contiguous task range holds a similar causal workload. */
    const int64_t bh = t / p->nqb, z = t % p->nqb;
    const int64_t qb = (z & 1) ? p->nqb - 1 - z / 2 : z / 2;
    const int64_t b = bh / p->Hq, h = bh % p->Hq, kvh = h / p->group;
    const int64_t q0 = qb * BQ, mq = ATTN_SUFFIX(min64)(BQ, p->Sq - q0);
    const int64_t qrow0 = bh * p->Sq + q0;
    const int64_t krow0 = (b * p->Hkv + kvh) * p->Sk;

    int64_t kend = p->Sk;
    if (p->causal) kend = ATTN_SUFFIX(max64)(0, ATTN_SUFFIX(min64)(p->Sk, p->q_start + q0 + mq - p->k_start));

    for (int64_t i = 0; i < mq; i++) {
      m2[i] = -INFINITY;
      l[i] = 0.0f;
    }
    memset(O, 0, sizeof(float) * (size_t)(mq * D));

    const float *Qa = NULL;
#if ATTN_HAS_BF16DOT
    uint16_t *Qb = (uint16_t *)Qf;
    if (dot16) {
      const uint16_t *src = (const uint16_t *)p->q + qrow0 * D;
      for (int64_t i = 0; i < mq; i++) {
        memcpy(Qb + i * Dp, src + i * D, sizeof(uint16_t) * (size_t)D);
        if (Dp != D) Qb[i * Dp + D] = 0;
      }
    } else
#endif
      Qa = ATTN_SUFFIX(rows_f32)(p, p->q, qrow0, mq, Qf);

    for (int64_t k0 = 0; k0 < kend; k0 += BK) {
      const int64_t nk = ATTN_SUFFIX(min64)(BK, kend - k0);
      /* The shared packed block, unless there is none or a cut-off odd block would pair its last key with one past
       * the cut (bfloat16 V pairs must be zero-padded there). */
      const void *Kblk = Kt, *Vblk = Vf;
      if (p->kvpack && !(dot16 && (nk & 1) && k0 + nk < p->Sk)) {
        const unsigned char *blk = p->kvpack + ((b * p->Hkv + kvh) * p->nkb + k0 / BK) * p->kvpack_bytes;
        Kblk = blk;
        Vblk = blk + kbytes;
      } else {
        ATTN_SUFFIX(fwd_pack_block)(p, dot16, krow0 + k0, nk, Kt, Vf);
      }
#if ATTN_HAS_BF16DOT
      if (dot16) {
        mk_gemm_bf16((int)mq, (int)nk, (int)(Dp / 2), Qb, (int)Dp, (const uint16_t *)Kblk, (int)LDK, S, BK, 0);
      } else
#endif
      {
        mk_gemm((int)mq, (int)nk, (int)D, Qa, (int)D, (const float *)Kblk, (int)LDK, S, BK, 0);
      }
      /* Online softmax over the keys each row sees (causal: a prefix of the tile; the rest become zeros). The
       * running maximum only moves when a row's scores pass it by more than 2^ATTN_RESCALE_SLACK, so most blocks
       * skip rescaling the accumulator row; exact either way, as l and lse use the maximum actually applied. */
      const int64_t diag = p->q_start + q0 - (p->k_start + k0) + 1;
      for (int64_t i = 0; i < mq; i++) {
        float *Si = S + i * BK;
        const int64_t vis = p->causal ? ATTN_SUFFIX(max64)(0, ATTN_SUFFIX(min64)(nk, diag + i)) : nk;
        const float mx = vis > 0 ? mk_rowmax(Si, (int)vis) : -INFINITY;
        if (mx == -INFINITY) {
          memset(Si, 0, sizeof(float) * (size_t)nk);
        } else {
          if (mx * c > m2[i] + ATTN_RESCALE_SLACK) {
            const float mnew = mx * c;
            const float alpha = exp2f(m2[i] - mnew); /* 0 on the row's first block */
            l[i] *= alpha;
            float *Oi = O + i * D;
            for (int64_t d = 0; d < D; d++) Oi[d] *= alpha;
            m2[i] = mnew;
          }
          l[i] += mk_exp2_row(Si, (int)vis, c, m2[i]);
          if (vis < nk) memset(Si + vis, 0, sizeof(float) * (size_t)(nk - vis));
        }
#if ATTN_HAS_BF16DOT
        if (dot16) {
          mk_cvt_bf16_row(Si, (int)nk, Pb + i * BK);
        }
#endif
      }

#if ATTN_HAS_BF16DOT
      if (dot16) {
        mk_gemm_bf16((int)mq, (int)D, (int)((nk + 1) / 2), Pb, BK, (const uint16_t *)Vblk, (int)LDV, O, (int)D, 1);
      } else
#endif
      {
        if (ATTN_SUFFIX(v_direct)(p))
          mk_gemm((int)mq, (int)D, (int)nk, S, BK, (const float *)p->v + (krow0 + k0) * D, (int)D, O, (int)D, 1);
        else
          mk_gemm((int)mq, (int)D, (int)nk, S, BK, (const float *)Vblk, (int)LDV, O, (int)D, 1);
      }
    }

    for (int64_t i = 0; i < mq; i++) {
      if (l[i] > 0.0f) {
        ATTN_SUFFIX(store_row)(p, p->out, qrow0 + i, O + i * D, 1.0f / l[i]);
        p->lse[qrow0 + i] = (m2[i] + log2f(l[i])) * ATTN_LN2;
      } else {
        memset(O + i * D, 0, sizeof(float) * (size_t)D);
        ATTN_SUFFIX(store_row)(p, p->out, qrow0 + i, O + i * D, 1.0f);
        p->lse[qrow0 + i] = -INFINITY;
      }
    }
  }
}

/* One task: the key blocks s, s + slabs, ... of one (batch, kv head). For each it walks every query block of every
 * q head sharing that kv head, accumulates dK and dV locally and adds dS K into this slab's dq accumulator. */
static void ATTN_SUFFIX(bwd)(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch) {
  enum { BQ = ATTN_BWD_BQ, BK = ATTN_BWD_BK };
  const int64_t D = p->D;
  const float c = p->scale * ATTN_LOG2E;

  float *Kt = (float *)scratch;       /* DMAX x BK */
  float *Vt = Kt + ATTN_DMAX * BK;    /* DMAX x BK */
  float *Kf = Vt + ATTN_DMAX * BK;    /* BK x DMAX */
  float *dK = Kf + BK * ATTN_DMAX;    /* BK x DMAX */
  float *dV = dK + BK * ATTN_DMAX;    /* BK x DMAX */
  float *Qf = dV + BK * ATTN_DMAX;    /* BQ x DMAX */
  float *dOf = Qf + BQ * ATTN_DMAX;   /* BQ x DMAX */
  float *S = dOf + BQ * ATTN_DMAX;    /* BQ x BK: scores, then P */
  float *dP = S + BQ * BK;            /* BQ x BK: dP, then dS */
  float *Pt = dP + BQ * BK;           /* BK x BQ */
  float *dSt = Pt + BK * BQ;          /* BK x BQ */

  const int64_t nrows_q = p->B * p->Hq * p->Sq;
  for (int64_t t = begin; t < end; t++) {
    const int64_t unit = t / p->slabs, s = t % p->slabs;
    const int64_t b = unit / p->Hkv, kvh = unit % p->Hkv;
    const int64_t krow0 = unit * p->Sk;
    float *dq_acc = p->dq_acc + s * nrows_q * D;

    for (int64_t kb = s; kb < p->nkb; kb += p->slabs) {
      const int64_t k0 = kb * BK, nk = ATTN_SUFFIX(min64)(BK, p->Sk - k0);
      ATTN_SUFFIX(pack_t_f32)(p, p->k, krow0 + k0, nk, Kt, BK);
      ATTN_SUFFIX(pack_t_f32)(p, p->v, krow0 + k0, nk, Vt, BK);
      const float *Ka = ATTN_SUFFIX(rows_f32)(p, p->k, krow0 + k0, nk, Kf);
      memset(dK, 0, sizeof(float) * (size_t)(nk * D));
      memset(dV, 0, sizeof(float) * (size_t)(nk * D));

      int64_t qfirst = 0;
      if (p->causal) qfirst = ATTN_SUFFIX(max64)(0, p->k_start + k0 - p->q_start);
      for (int64_t hh = 0; hh < p->group && qfirst < p->Sq; hh++) {
        const int64_t rowbase = (b * p->Hq + kvh * p->group + hh) * p->Sq;
        for (int64_t q0 = (qfirst / BQ) * BQ; q0 < p->Sq; q0 += BQ) {
          const int64_t mq = ATTN_SUFFIX(min64)(BQ, p->Sq - q0);
          const float *Qa = ATTN_SUFFIX(rows_f32)(p, p->q, rowbase + q0, mq, Qf);
          const float *dOa = ATTN_SUFFIX(rows_f32)(p, p->dout, rowbase + q0, mq, dOf);

          mk_gemm((int)mq, (int)nk, (int)D, Qa, (int)D, Kt, BK, S, BK, 0);
          if (p->causal) ATTN_SUFFIX(mask_tile)(p, S, BK, q0, mq, k0, nk);
          mk_gemm((int)mq, (int)nk, (int)D, dOa, (int)D, Vt, BK, dP, BK, 0);
          for (int64_t i = 0; i < mq; i++) {
            float *Si = S + i * BK, *dPi = dP + i * BK;
            const float L = p->lse_in[rowbase + q0 + i];
            if (L == -INFINITY || L != L) {
              memset(Si, 0, sizeof(float) * (size_t)nk);
              memset(dPi, 0, sizeof(float) * (size_t)nk);
              continue;
            }
            mk_exp2_row(Si, (int)nk, c, L * ATTN_LOG2E);
            const float Di = p->delta[rowbase + q0 + i];
            for (int64_t j = 0; j < nk; j++) dPi[j] = Si[j] * (dPi[j] - Di);
          }
#if defined(ATTN_HAS_GEMM_AT)
          (void)Pt;
          (void)dSt;
          mk_gemm_at((int)nk, (int)D, (int)mq, S, BK, dOa, (int)D, dV, (int)D, 1);
          mk_gemm_at((int)nk, (int)D, (int)mq, dP, BK, Qa, (int)D, dK, (int)D, 1);
#else
          for (int64_t i = 0; i < mq; i++)
            for (int64_t j = 0; j < nk; j++) {
              Pt[j * BQ + i] = S[i * BK + j];
              dSt[j * BQ + i] = dP[i * BK + j];
            }
          mk_gemm((int)nk, (int)D, (int)mq, Pt, BQ, dOa, (int)D, dV, (int)D, 1);
          mk_gemm((int)nk, (int)D, (int)mq, dSt, BQ, Qa, (int)D, dK, (int)D, 1);
#endif
          mk_gemm((int)mq, (int)D, (int)nk, dP, BK, Ka, (int)D, dq_acc + (rowbase + q0) * D, (int)D, 1);
        }
      }
      for (int64_t j = 0; j < nk; j++) {
        ATTN_SUFFIX(store_row)(p, p->dk, krow0 + k0 + j, dK + j * D, p->scale);
        ATTN_SUFFIX(store_row)(p, p->dv, krow0 + k0 + j, dV + j * D, 1.0f);
      }
    }
  }
}

const t3d__attn_isa_ops ATTN_SUFFIX(t3d__attn_ops) = {ATTN_SUFFIX(fwd), ATTN_SUFFIX(bwd), ATTN_SUFFIX(fwd_pack)};
