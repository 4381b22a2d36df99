/* Public entry points of the CPU attention kernels: argument checks, run-time ISA choice, the task split (caller's
 * parallel-for or a small internal pthread team), and the cheap element-wise passes (backward's dout.out and dq
 * reduction, the log-sum-exp merge). The tiled work lives in attn_cpu_impl.h, built once per ISA. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attn_cpu_internal.h"

/* ---------------------------------------------------------------- ISA choice */

static int cpu_has_avx2(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return 0;
#endif
}

static int cpu_has_avx512(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
#else
  return 0;
#endif
}

static int cpu_has_bf16dot(void) {
#if defined(__x86_64__) || defined(__i386__)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return 0;
#endif
}

/* AMX tiles need AVX512_BF16 as well (the softmax packs P with vcvtne2ps2bf16) and the kernel's permission. */
static int cpu_has_amx(void) {
#if defined(T3D_ATTN_HAVE_AMX)
  return cpu_has_bf16dot() && t3d__attn_amx_usable();
#else
  return 0;
#endif
}

/* bfloat16 forward through vdpbf16ps (AVX-512 only). Off unless T3D_ATTN_BF16DOT=1: on the Xeon it was measured on
 * (avx512_bf16, AMX) widening to float32 and using FMAs ran the forward ~1.4x faster than vdpbf16ps, and it keeps P
 * in float32 instead of rounding it to bfloat16. Read per call like T3D_ATTN_ISA. */
static int use_bf16dot(t3d_attn_isa_t isa) {
  const char *env = getenv("T3D_ATTN_BF16DOT");
  return isa == T3D_ATTN_ISA_AVX512 && env && !strcmp(env, "1") && cpu_has_bf16dot();
}

int t3d_attn_isa_available(t3d_attn_isa_t isa) {
  switch (isa) {
    case T3D_ATTN_ISA_AUTO:
    case T3D_ATTN_ISA_SCALAR: return 1;
    case T3D_ATTN_ISA_AVX2: return cpu_has_avx2();
    case T3D_ATTN_ISA_AVX512: return cpu_has_avx512();
    case T3D_ATTN_ISA_AMX: return cpu_has_amx();
  }
  return 0;
}

static t3d_attn_isa_t best_isa_upto(t3d_attn_isa_t cap) {
  if (cap >= T3D_ATTN_ISA_AMX && cpu_has_amx()) return T3D_ATTN_ISA_AMX;
  if (cap >= T3D_ATTN_ISA_AVX512 && cpu_has_avx512()) return T3D_ATTN_ISA_AVX512;
  if (cap >= T3D_ATTN_ISA_AVX2 && cpu_has_avx2()) return T3D_ATTN_ISA_AVX2;
  return T3D_ATTN_ISA_SCALAR;
}

/* Read on every call (a getenv is cheap next to an attention call) so tests can switch paths in one process. A
 * forced path this CPU lacks falls back to the best one below it. */
t3d_attn_isa_t t3d_attn_isa_selected(void) {
  const char *env = getenv("T3D_ATTN_ISA");
  if (env && *env) {
    if (!strcmp(env, "scalar")) return T3D_ATTN_ISA_SCALAR;
    if (!strcmp(env, "avx2")) return best_isa_upto(T3D_ATTN_ISA_AVX2);
    if (!strcmp(env, "avx512")) return best_isa_upto(T3D_ATTN_ISA_AVX512);
    if (!strcmp(env, "amx")) return best_isa_upto(T3D_ATTN_ISA_AMX);
  }
  return best_isa_upto(T3D_ATTN_ISA_AMX);
}

const char *t3d_attn_isa_name(t3d_attn_isa_t isa) {
  switch (isa) {
    case T3D_ATTN_ISA_AUTO: return "auto";
    case T3D_ATTN_ISA_SCALAR: return "scalar";
    case T3D_ATTN_ISA_AVX2: return "avx2";
    case T3D_ATTN_ISA_AVX512: return "avx512";
    case T3D_ATTN_ISA_AMX: return "amx";
  }
  return "unknown";
}

const char *t3d_attn_isa_describe(t3d_attn_isa_t isa, t3d_attn_dtype_t dtype) {
  if (isa == T3D_ATTN_ISA_AUTO) isa = t3d_attn_isa_selected();
  if (dtype == T3D_ATTN_BFLOAT16 && use_bf16dot(isa)) return "avx512-bf16";
  if (isa == T3D_ATTN_ISA_AMX && dtype != T3D_ATTN_BFLOAT16) return "avx512";
  return t3d_attn_isa_name(isa);
}

static int resolve_isa(const t3d_attn_exec_t *exec, t3d_attn_isa_t *isa) {
  t3d_attn_isa_t want = exec ? exec->isa : T3D_ATTN_ISA_AUTO;
  if (want == T3D_ATTN_ISA_AUTO) {
    *isa = t3d_attn_isa_selected();
    return T3D_ATTN_OK;
  }
  if (want < T3D_ATTN_ISA_SCALAR || want > T3D_ATTN_ISA_AMX) return T3D_ATTN_ERR_INVALID_ARG;
  if (!t3d_attn_isa_available(want)) return T3D_ATTN_ERR_UNSUPPORTED;
  *isa = want;
  return T3D_ATTN_OK;
}

#if defined(T3D_ATTN_HAVE_AMX)
static const t3d__attn_isa_ops amx_ops = {t3d__attn_amx_fwd, t3d__attn_amx_bwd, t3d__attn_amx_fwd_pack};
#endif

/* AMX covers bfloat16; float32 under it runs the AVX-512 drivers. */
static const t3d__attn_isa_ops *isa_ops(t3d_attn_isa_t isa, t3d_attn_dtype_t dtype) {
  switch (isa) {
#if defined(T3D_ATTN_HAVE_AMX)
    case T3D_ATTN_ISA_AMX: return dtype == T3D_ATTN_BFLOAT16 ? &amx_ops : &t3d__attn_ops_avx512;
#endif
    case T3D_ATTN_ISA_AVX512: return &t3d__attn_ops_avx512;
    case T3D_ATTN_ISA_AVX2: return &t3d__attn_ops_avx2;
    default: return &t3d__attn_ops_scalar;
  }
}

/* ---------------------------------------------------------------- task runner */

typedef void (*task_fn)(void *ctx, int64_t begin, int64_t end, void *scratch);

typedef struct {
  task_fn fn;
  void *ctx;
  size_t scratch_bytes;
  int64_t n;
  atomic_llong next; /* internal team: next unclaimed task */
  atomic_int err;
} run_t;

/* Buffers come from a small pool of blocks freed by earlier calls: the per-call buffers (thread scratch, packed
 * K/V, dq accumulators) are big enough that malloc would map them afresh and fault every page in on every call.
 * Each block carries its capacity in a 64-byte header. */
enum { POOL_SLOTS = 8 };
#define POOL_KEEP_BYTES ((size_t)1 << 30) /* at most this much is kept */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned char *pool_blk[POOL_SLOTS];
static size_t pool_cap[POOL_SLOTS];

static void *scratch_alloc(size_t bytes) {
  if (!bytes) return NULL;
  bytes = (bytes + 63) & ~(size_t)63;
  pthread_mutex_lock(&pool_mu);
  int best = -1;
  for (int i = 0; i < POOL_SLOTS; i++)
    if (pool_blk[i] && pool_cap[i] >= bytes && (best < 0 || pool_cap[i] < pool_cap[best])) best = i;
  unsigned char *blk = NULL;
  if (best >= 0) {
    blk = pool_blk[best];
    pool_blk[best] = NULL;
  }
  pthread_mutex_unlock(&pool_mu);
  if (!blk) {
    blk = (unsigned char *)aligned_alloc(64, bytes + 64);
    if (!blk) return NULL;
    memcpy(blk, &bytes, sizeof bytes);
  }
  return blk + 64;
}

static void scratch_free(void *ptr) {
  if (!ptr) return;
  unsigned char *blk = (unsigned char *)ptr - 64;
  size_t cap;
  memcpy(&cap, blk, sizeof cap);
  pthread_mutex_lock(&pool_mu);
  size_t kept = 0;
  int slot = -1;
  for (int i = 0; i < POOL_SLOTS; i++) {
    if (pool_blk[i])
      kept += pool_cap[i];
    else if (slot < 0)
      slot = i;
  }
  if (slot < 0) { /* full: the smallest kept block makes room if this one is bigger */
    int small = 0;
    for (int i = 1; i < POOL_SLOTS; i++)
      if (pool_cap[i] < pool_cap[small]) small = i;
    if (pool_cap[small] < cap) {
      kept -= pool_cap[small];
      free(pool_blk[small]);
      pool_blk[small] = NULL;
      slot = small;
    }
  }
  if (slot >= 0 && kept + cap <= POOL_KEEP_BYTES) {
    pool_blk[slot] = blk;
    pool_cap[slot] = cap;
    blk = NULL;
  }
  pthread_mutex_unlock(&pool_mu);
  free(blk);
}

/* Body handed to the caller's parallel-for: one scratch per call (at::parallel_for calls it once per thread). */
/* Tasks are claimed one at a time from a shared counter, so uneven (causal) tasks and threads the OS delays balance
 * themselves: the internal team runs this, and so does each chunk of the caller's parallel-for, which is asked for
 * one chunk per thread and ignores the chunk bounds (a chunk that starts late finds the work already done). */
static void *run_worker(void *arg) {
  run_t *r = (run_t *)arg;
  void *scratch = scratch_alloc(r->scratch_bytes);
  if (r->scratch_bytes && !scratch) {
    atomic_store(&r->err, T3D_ATTN_ERR_NO_MEMORY);
    return NULL;
  }
  for (;;) {
    const int64_t t = (int64_t)atomic_fetch_add(&r->next, 1);
    if (t >= r->n) break;
    r->fn(r->ctx, t, t + 1, scratch);
  }
  scratch_free(scratch);
  return NULL;
}

static void run_body_ext(void *arg, int64_t begin, int64_t end) {
  (void)begin;
  (void)end;
  run_worker(arg);
}

static int exec_threads(const t3d_attn_exec_t *exec) {
  int nt = exec ? exec->nthreads : 0;
  if (nt <= 0) {
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    nt = c > 0 ? (int)c : 1;
  }
  return nt;
}

static int run_tasks(const t3d_attn_exec_t *exec, int64_t n, task_fn fn, void *ctx, size_t scratch_bytes) {
  if (n <= 0) return T3D_ATTN_OK;
  run_t r;
  r.fn = fn;
  r.ctx = ctx;
  r.scratch_bytes = scratch_bytes;
  r.n = n;
  atomic_init(&r.next, 0);
  atomic_init(&r.err, T3D_ATTN_OK);
  int64_t nt = exec_threads(exec);
  if (nt > n) nt = n;
  if (exec && exec->parallel_for) {
    exec->parallel_for(exec->parallel_ctx, nt, run_body_ext, &r);
    /* Every task ran, unless a chunk could not get its scratch (err says so) or the parallel-for ran no chunk. */
    if (atomic_load(&r.err) == T3D_ATTN_OK && atomic_load(&r.next) < n) atomic_store(&r.err, T3D_ATTN_ERR_NO_MEMORY);
    return atomic_load(&r.err);
  }
  if (nt > 256) nt = 256;
  pthread_t tids[256];
  int64_t started = 0;
  for (int64_t i = 1; i < nt; i++) {
    if (pthread_create(&tids[started], NULL, run_worker, &r) != 0) break;
    started++;
  }
  run_worker(&r); /* the caller works too, and finishes whatever failed threads left */
  for (int64_t i = 0; i < started; i++) pthread_join(tids[i], NULL);
  return atomic_load(&r.err);
}

/* ---------------------------------------------------------------- argument checks */

static int check_shape(t3d_attn_dtype_t dtype, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t seq_q,
                       int64_t seq_k, int64_t head_dim) {
  if (dtype != T3D_ATTN_FLOAT32 && dtype != T3D_ATTN_BFLOAT16) return T3D_ATTN_ERR_INVALID_ARG;
  if (batch < 0 || seq_q < 0 || seq_k < 0) return T3D_ATTN_ERR_INVALID_ARG;
  if (q_heads <= 0 || kv_heads <= 0 || q_heads % kv_heads != 0) return T3D_ATTN_ERR_INVALID_ARG;
  if (head_dim <= 0 || head_dim > T3D_ATTN_MAX_HEAD_DIM) return T3D_ATTN_ERR_INVALID_ARG;
  /* Element counts must fit comfortably in int64. */
  const double elems = (double)batch * (double)q_heads * (double)(seq_q > seq_k ? seq_q : seq_k) * (double)head_dim;
  if (elems > 4.0e18) return T3D_ATTN_ERR_INVALID_ARG;
  return T3D_ATTN_OK;
}

static float resolve_scale(float scale, int64_t head_dim) {
  if (isnan(scale) || scale <= 0.0f || isinf(scale)) return 1.0f / sqrtf((float)head_dim);
  return scale;
}

/* ---------------------------------------------------------------- forward */

typedef struct {
  t3d__attn_problem p;
  const t3d__attn_isa_ops *ops;
} attn_job;

static void fwd_job(void *ctx, int64_t begin, int64_t end, void *scratch) {
  attn_job *j = (attn_job *)ctx;
  j->ops->fwd(&j->p, begin, end, scratch);
}

static void pack_job(void *ctx, int64_t begin, int64_t end, void *scratch) {
  attn_job *j = (attn_job *)ctx;
  j->ops->fwd_pack(&j->p, begin, end, scratch);
}

#if defined(T3D_ATTN_HAVE_AMX)
static void bwd_qpack_job(void *ctx, int64_t begin, int64_t end, void *scratch) {
  attn_job *j = (attn_job *)ctx;
  t3d__attn_amx_bwd_pack(&j->p, begin, end, scratch);
}
#endif

static void bwd_job(void *ctx, int64_t begin, int64_t end, void *scratch) {
  attn_job *j = (attn_job *)ctx;
  j->ops->bwd(&j->p, begin, end, scratch);
}

int t3d_attn_forward(t3d_attn_dtype_t dtype, const void *q, const void *k, const void *v, void *out, float *lse,
                     int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t seq_q, int64_t seq_k,
                     int64_t head_dim, int causal, float scale, int64_t q_start, int64_t k_start,
                     const t3d_attn_exec_t *exec) {
  int rc = check_shape(dtype, batch, q_heads, kv_heads, seq_q, seq_k, head_dim);
  if (rc) return rc;
  t3d_attn_isa_t isa;
  rc = resolve_isa(exec, &isa);
  if (rc) return rc;
  const int64_t nq = batch * q_heads * seq_q, nk = batch * kv_heads * seq_k;
  if (nq > 0 && (!q || !out || !lse)) return T3D_ATTN_ERR_INVALID_ARG;
  if (nq > 0 && nk > 0 && (!k || !v)) return T3D_ATTN_ERR_INVALID_ARG;
  if (nq == 0) return T3D_ATTN_OK;

  attn_job j;
  memset(&j, 0, sizeof j);
  j.ops = isa_ops(isa, dtype);
  t3d__attn_problem *p = &j.p;
  p->dtype = dtype;
  p->use_bf16dot = use_bf16dot(isa);
  p->q = q;
  p->k = k;
  p->v = v;
  p->out = out;
  p->lse = lse;
  p->B = batch;
  p->Hq = q_heads;
  p->Hkv = kv_heads;
  p->Sq = seq_q;
  p->Sk = seq_k;
  p->D = head_dim;
  p->group = q_heads / kv_heads;
  p->causal = causal != 0;
  p->scale = resolve_scale(scale, head_dim);
  p->q_start = q_start;
  p->k_start = k_start;
  p->nqb = (seq_q + ATTN_FWD_BQ - 1) / ATTN_FWD_BQ;
  p->nkb = (seq_k + ATTN_FWD_BK - 1) / ATTN_FWD_BK;
  p->slabs = 1;

  /* Pack every key block of every (batch, kv head) once, in parallel, when several query blocks will read it;
   * without that each query-block task re-packs all the K and V blocks it visits. Skipped (each task packs for
   * itself) when the buffer would be very large or cannot be had. */
  unsigned char *kvpack = NULL;
  const int64_t units = batch * kv_heads;
  if (p->nkb > 0 && p->nqb * p->group > 1) {
    const int dot16 = p->use_bf16dot && dtype == T3D_ATTN_BFLOAT16;
    int64_t blk = t3d__attn_fwd_kbytes(head_dim, dot16) + t3d__attn_fwd_vbytes(head_dim, dot16);
#if defined(T3D_ATTN_HAVE_AMX)
    if (isa == T3D_ATTN_ISA_AMX && dtype == T3D_ATTN_BFLOAT16) blk = t3d__attn_amx_fwd_block_bytes(head_dim);
#endif
    const double total = (double)units * (double)p->nkb * (double)blk;
    if (total <= 2.0e9) kvpack = (unsigned char *)scratch_alloc((size_t)total);
    if (kvpack) {
      p->kvpack = kvpack;
      p->kvpack_bytes = blk;
      rc = run_tasks(exec, units * p->nkb, pack_job, &j, 0);
      if (rc) {
        scratch_free(kvpack);
        return rc;
      }
    }
  }
  rc = run_tasks(exec, batch * q_heads * p->nqb, fwd_job, &j, ATTN_SCRATCH_FLOATS * sizeof(float));
  scratch_free(kvpack);
  return rc;
}

/* ---------------------------------------------------------------- backward */

enum { ROWS_PER_TASK = 128 };

static float row_dot(const t3d__attn_problem *p, const void *a, const void *b, int64_t row) {
  const int64_t D = p->D;
  float s = 0.0f;
  if (p->dtype == T3D_ATTN_FLOAT32) {
    const float *x = (const float *)a + row * D, *y = (const float *)b + row * D;
    for (int64_t d = 0; d < D; d++) s += x[d] * y[d];
  } else {
    const uint16_t *x = (const uint16_t *)a + row * D, *y = (const uint16_t *)b + row * D;
    for (int64_t d = 0; d < D; d++) s += t3d__bf16_to_f32(x[d]) * t3d__bf16_to_f32(y[d]);
  }
  return s;
}

/* delta = dout . out per query row; the dq accumulators start at zero. */
static void bwd_prep_job(void *ctx, int64_t begin, int64_t end, void *scratch) {
  (void)scratch;
  const t3d__attn_problem *p = &((attn_job *)ctx)->p;
  const int64_t rows = p->B * p->Hq * p->Sq;
  const int64_t r0 = begin * ROWS_PER_TASK, r1 = end * ROWS_PER_TASK < rows ? end * ROWS_PER_TASK : rows;
  for (int64_t r = r0; r < r1; r++) p->delta[r] = row_dot(p, p->dout, p->out_in, r);
  for (int64_t s = 0; s < p->slabs; s++)
    memset(p->dq_acc + (s * rows + r0) * p->D, 0, sizeof(float) * (size_t)((r1 - r0) * p->D));
}

/* dq = scale * sum over slabs of the accumulators, in dtype (in place when dq itself was the accumulator). */
static void bwd_finish_job(void *ctx, int64_t begin, int64_t end, void *scratch) {
  (void)scratch;
  const t3d__attn_problem *p = &((attn_job *)ctx)->p;
  const int64_t rows = p->B * p->Hq * p->Sq, D = p->D;
  const int64_t r0 = begin * ROWS_PER_TASK, r1 = end * ROWS_PER_TASK < rows ? end * ROWS_PER_TASK : rows;
  for (int64_t r = r0; r < r1; r++) {
    float *acc = p->dq_acc + r * D;
    for (int64_t s = 1; s < p->slabs; s++) {
      const float *o = p->dq_acc + (s * rows + r) * D;
      for (int64_t d = 0; d < D; d++) acc[d] += o[d];
    }
    if (p->dtype == T3D_ATTN_FLOAT32) {
      float *dst = (float *)p->dq + r * D;
      for (int64_t d = 0; d < D; d++) dst[d] = acc[d] * p->scale;
    } else {
      uint16_t *dst = (uint16_t *)p->dq + r * D;
      for (int64_t d = 0; d < D; d++) dst[d] = t3d__f32_to_bf16(acc[d] * p->scale);
    }
  }
}

int t3d_attn_backward(t3d_attn_dtype_t dtype, const void *dout, const void *q, const void *k, const void *v,
                      const void *out, const float *lse, void *dq, void *dk, void *dv, int64_t batch,
                      int64_t q_heads, int64_t kv_heads, int64_t seq_q, int64_t seq_k, int64_t head_dim, int causal,
                      float scale, int64_t q_start, int64_t k_start, const t3d_attn_exec_t *exec) {
  int rc = check_shape(dtype, batch, q_heads, kv_heads, seq_q, seq_k, head_dim);
  if (rc) return rc;
  t3d_attn_isa_t isa;
  rc = resolve_isa(exec, &isa);
  if (rc) return rc;
  const int64_t nq = batch * q_heads * seq_q, nk = batch * kv_heads * seq_k;
  if (nq > 0 && (!dout || !q || !out || !lse || !dq)) return T3D_ATTN_ERR_INVALID_ARG;
  if (nk > 0 && (!k || !v || !dk || !dv)) return T3D_ATTN_ERR_INVALID_ARG;
  if (nq == 0 && nk == 0) return T3D_ATTN_OK;

  attn_job j;
  memset(&j, 0, sizeof j);
  j.ops = isa_ops(isa, dtype);
  t3d__attn_problem *p = &j.p;
  p->dtype = dtype;
  p->use_bf16dot = 0; /* the backward computes in float32 on every path */
  p->dout = dout;
  p->q = q;
  p->k = k;
  p->v = v;
  p->out_in = out;
  p->lse_in = lse;
  p->dq = dq;
  p->dk = dk;
  p->dv = dv;
  p->B = batch;
  p->Hq = q_heads;
  p->Hkv = kv_heads;
  p->Sq = seq_q;
  p->Sk = seq_k;
  p->D = head_dim;
  p->group = q_heads / kv_heads;
  p->causal = causal != 0;
  p->scale = resolve_scale(scale, head_dim);
  p->q_start = q_start;
  p->k_start = k_start;
  p->nqb = (seq_q + ATTN_BWD_BQ - 1) / ATTN_BWD_BQ;
  p->nkb = (seq_k + ATTN_BWD_BK - 1) / ATTN_BWD_BK;

  /* Key blocks of one (batch, kv head) are split over several tasks only when there are too few (batch, kv head)
   * pairs to keep the threads busy; each such slab then needs its own float32 dq accumulator. */
  const int64_t units = batch * kv_heads;
  const int64_t nt = exec_threads(exec);
  int64_t slabs = 1;
  if (units > 0 && units < 2 * nt) slabs = (2 * nt + units - 1) / units;
  if (slabs > p->nkb) slabs = p->nkb > 0 ? p->nkb : 1;
  const double acc_bytes = (double)nq * (double)head_dim * sizeof(float);
  while (slabs > 1 && acc_bytes * (double)slabs > 1.0e9) slabs--;
  p->slabs = slabs;

  float *owned = NULL;
  if (dtype == T3D_ATTN_FLOAT32 && slabs == 1) {
    p->dq_acc = (float *)dq;
  } else if (nq > 0) {
    owned = (float *)scratch_alloc((size_t)slabs * (size_t)nq * (size_t)head_dim * sizeof(float));
    if (!owned) return T3D_ATTN_ERR_NO_MEMORY;
    p->dq_acc = owned;
  }
  float *delta = NULL;
  if (nq > 0) {
    delta = (float *)scratch_alloc((size_t)nq * sizeof(float));
    if (!delta) {
      scratch_free(owned);
      return T3D_ATTN_ERR_NO_MEMORY;
    }
  }
  p->delta = delta;

  const int64_t row_tasks = (nq + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  rc = run_tasks(exec, row_tasks, bwd_prep_job, &j, 0);
#if defined(T3D_ATTN_HAVE_AMX)
  unsigned char *qpack = NULL;
  if (!rc && j.ops == &amx_ops && p->nkb > 0 && nq > 0) {
    p->bwd_qpack_bytes = t3d__attn_amx_bwd_qbytes(p);
    qpack = (unsigned char *)scratch_alloc((size_t)(batch * q_heads * p->bwd_qpack_bytes));
    if (!qpack) rc = T3D_ATTN_ERR_NO_MEMORY;
    p->bwd_qpack = qpack;
    if (!rc) rc = run_tasks(exec, batch * q_heads, bwd_qpack_job, &j, 0);
  }
#endif
  if (!rc && p->nkb > 0) rc = run_tasks(exec, units * slabs, bwd_job, &j, ATTN_SCRATCH_FLOATS * sizeof(float));
  if (!rc) rc = run_tasks(exec, row_tasks, bwd_finish_job, &j, 0);
#if defined(T3D_ATTN_HAVE_AMX)
  scratch_free(qpack);
#endif
  scratch_free(delta);
  scratch_free(owned);
  return rc;
}

/* ---------------------------------------------------------------- merge */

typedef struct {
  t3d_attn_dtype_t out_dtype, block_dtype;
  void *out;
  float *lse;
  const void *block_out;
  const float *block_lse;
  int64_t rows, D;
} merge_job_t;

static inline float load_elem(t3d_attn_dtype_t dt, const void *base, int64_t i) {
  return dt == T3D_ATTN_FLOAT32 ? ((const float *)base)[i] : t3d__bf16_to_f32(((const uint16_t *)base)[i]);
}

static void merge_job(void *ctx, int64_t begin, int64_t end, void *scratch) {
  (void)scratch;
  const merge_job_t *m = (const merge_job_t *)ctx;
  const int64_t D = m->D;
  const int64_t r0 = begin * ROWS_PER_TASK, r1 = end * ROWS_PER_TASK < m->rows ? end * ROWS_PER_TASK : m->rows;
  for (int64_t r = r0; r < r1; r++) {
    const float a = m->lse[r], bl = m->block_lse[r];
    if (bl == -INFINITY) continue;
    float wa, wb, nl;
    if (a == -INFINITY) {
      wa = 0.0f;
      wb = 1.0f;
      nl = bl;
    } else {
      const float mx = a > bl ? a : bl;
      nl = mx + log1pf(expf(-fabsf(a - bl)));
      wa = expf(a - nl);
      wb = expf(bl - nl);
    }
    m->lse[r] = nl;
    if (m->out_dtype == T3D_ATTN_FLOAT32) {
      float *o = (float *)m->out + r * D;
      if (m->block_dtype == T3D_ATTN_FLOAT32) {
        const float *x = (const float *)m->block_out + r * D;
        for (int64_t d = 0; d < D; d++) o[d] = wa == 0.0f ? x[d] * wb : o[d] * wa + x[d] * wb;
      } else {
        for (int64_t d = 0; d < D; d++) {
          const float x = load_elem(m->block_dtype, m->block_out, r * D + d);
          o[d] = wa == 0.0f ? x * wb : o[d] * wa + x * wb;
        }
      }
    } else {
      uint16_t *o = (uint16_t *)m->out + r * D;
      for (int64_t d = 0; d < D; d++) {
        const float x = load_elem(m->block_dtype, m->block_out, r * D + d);
        const float y = wa == 0.0f ? x * wb : t3d__bf16_to_f32(o[d]) * wa + x * wb;
        o[d] = t3d__f32_to_bf16(y);
      }
    }
  }
}

int t3d_attn_merge(t3d_attn_dtype_t out_dtype, void *out, float *lse, t3d_attn_dtype_t block_dtype,
                   const void *block_out, const float *block_lse, int64_t rows, int64_t head_dim,
                   const t3d_attn_exec_t *exec) {
  if (out_dtype != T3D_ATTN_FLOAT32 && out_dtype != T3D_ATTN_BFLOAT16) return T3D_ATTN_ERR_INVALID_ARG;
  if (block_dtype != T3D_ATTN_FLOAT32 && block_dtype != T3D_ATTN_BFLOAT16) return T3D_ATTN_ERR_INVALID_ARG;
  if (rows < 0 || head_dim < 0) return T3D_ATTN_ERR_INVALID_ARG;
  if (rows == 0) return T3D_ATTN_OK;
  if (!lse || !block_lse || (head_dim > 0 && (!out || !block_out))) return T3D_ATTN_ERR_INVALID_ARG;
  merge_job_t m = {out_dtype, block_dtype, out, lse, block_out, block_lse, rows, head_dim};
  const int64_t tasks = (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  /* Small merges are not worth waking threads for. */
  if ((double)rows * (double)head_dim < 262144.0) {
    merge_job(&m, 0, tasks, NULL);
    return T3D_ATTN_OK;
  }
  return run_tasks(exec, tasks, merge_job, &m, 0);
}
