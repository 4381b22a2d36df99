/* Internal to the CPU attention kernels: the problem description shared by the dispatcher (attn_cpu.c) and the
 * per-ISA drivers (attn_cpu_impl.h compiled once per ISA file). */
#ifndef T3D_ATTN_CPU_INTERNAL_H
#define T3D_ATTN_CPU_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "t3d_attn.h"
/* t3d__bf16_to_f32 / t3d__f32_to_bf16 (round to nearest even; NaN stays NaN, quiet): libt3d converts with the same
 * code (c_src/include/t3d_half.h, header-only: this library does not link libt3d). */
#include "t3d_half.h"

/* Tile sizes. Forward: a task owns ATTN_FWD_BQ queries of one (batch, head) and walks the keys ATTN_FWD_BK at a
 * time. Backward: a task owns key blocks of ATTN_BWD_BK keys of one (batch, kv head) and walks the queries
 * ATTN_BWD_BQ at a time. */
#define ATTN_FWD_BQ 64
#define ATTN_FWD_BK 128
#define ATTN_BWD_BQ 64
#define ATTN_BWD_BK 64
#define ATTN_DMAX T3D_ATTN_MAX_HEAD_DIM
/* Forward's packed K^T / V leading dimensions: padded so a 512-byte stride does not map a GEMM panel's rows onto a
 * few L1 sets. */
#define ATTN_FWD_LDK(D) ((int64_t)ATTN_FWD_BK + 16)
#define ATTN_FWD_LDV(D) ((int64_t)(D) + 16)

/* Bytes of one forward key block packed for the GEMMs: K^T then V. dot16: bfloat16 pairs (one 32-bit lane per
 * pair); otherwise float32. */
static inline int64_t t3d__attn_fwd_kbytes(int64_t D, int dot16) {
  return 4 * (dot16 ? (D + 1) / 2 : D) * ATTN_FWD_LDK(D);
}
static inline int64_t t3d__attn_fwd_vbytes(int64_t D, int dot16) {
  return 4 * (dot16 ? ATTN_FWD_BK / 2 : ATTN_FWD_BK) * ATTN_FWD_LDV(D);
}

typedef struct t3d__attn_problem {
  t3d_attn_dtype_t dtype;
  int use_bf16dot; /* AVX-512 path only: bfloat16 operands go through vdpbf16ps */
  const void *q, *k, *v;
  void *out;
  float *lse;
  /* backward */
  const void *dout, *out_in;
  const float *lse_in;
  void *dq, *dk, *dv;
  float *delta;  /* [B*Hq*Sq] dout . out */
  float *dq_acc; /* [slabs][B*Hq*Sq*D] float32 dq accumulators (== dq when float32 and one slab) */
  int64_t slabs; /* key blocks of one (batch, kv head) split round-robin over this many tasks */

  int64_t B, Hq, Hkv, Sq, Sk, D, group; /* group = Hq / Hkv */
  int causal;
  float scale;
  int64_t q_start, k_start;
  int64_t nqb, nkb; /* query / key blocks of the pass being run */
  /* forward: every key block of every (batch, kv head) packed once up front (NULL: each task packs its own),
   * block (b * Hkv + kvh) * nkb + kb at kvpack + that index * kvpack_bytes, K^T then V. */
  unsigned char *kvpack;
  int64_t kvpack_bytes;
  /* backward, AMX path: per (batch, q head) query-side packs made by a pre-pass, bwd_qpack_bytes each */
  unsigned char *bwd_qpack;
  int64_t bwd_qpack_bytes;
} t3d__attn_problem;

/* Per-ISA driver entry points. task ranges index the pass's task list; scratch is per thread, scratch_bytes big. */
typedef struct t3d__attn_isa_ops {
  void (*fwd)(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch);
  void (*bwd)(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch);
  /* forward pre-pass: packs key blocks [begin, end) (indexed as for kvpack) into p->kvpack */
  void (*fwd_pack)(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch);
} t3d__attn_isa_ops;

extern const t3d__attn_isa_ops t3d__attn_ops_scalar;
extern const t3d__attn_isa_ops t3d__attn_ops_avx2;
extern const t3d__attn_isa_ops t3d__attn_ops_avx512;

/* AMX-BF16 path (attn_cpu_amx.c, built when the compiler knows the AMX intrinsics: T3D_ATTN_HAVE_AMX). bfloat16
 * only. usable: the CPU has the tiles and the kernel granted this process their state (asked once). */
int t3d__attn_amx_usable(void);
int64_t t3d__attn_amx_fwd_block_bytes(int64_t D);
void t3d__attn_amx_fwd(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch);
void t3d__attn_amx_fwd_pack(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch);
void t3d__attn_amx_bwd(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch);
/* backward pre-pass over (batch, q head) [begin, end): bwd_qpack, t3d__attn_amx_bwd_qbytes(p) bytes each */
int64_t t3d__attn_amx_bwd_qbytes(const t3d__attn_problem *p);
void t3d__attn_amx_bwd_pack(const t3d__attn_problem *p, int64_t begin, int64_t end, void *scratch);

/* Generous per-thread scratch for either pass (floats), sized for ATTN_DMAX. */
#define ATTN_SCRATCH_FLOATS                                                                                      \
  ((size_t)(4 * ATTN_DMAX * 128 + 6 * 128 * 128 + 8 * 128 + 4096))

#endif
