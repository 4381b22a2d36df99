/* t3d_attn.h: CPU flash-style attention kernels (forward, backward, log-sum-exp merge). C11, no torch.
 * Layout [batch, heads, seq, head_dim], contiguous, like SDPA. Error codes mirror t3d_result_t in t3d.h. */
#ifndef T3D_ATTN_H
#define T3D_ATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  T3D_ATTN_OK = 0,
  T3D_ATTN_ERR_INVALID_ARG = -1, /* NULL pointer, bad shape, q_heads % kv_heads != 0, head_dim 0 or > 256 */
  T3D_ATTN_ERR_NO_MEMORY = -6,
  T3D_ATTN_ERR_UNSUPPORTED = -7, /* an explicitly requested ISA that this CPU (or build) lacks */
  T3D_ATTN_ERR_SYSTEM = -8       /* pthread_create failed */
};

#define T3D_ATTN_MAX_HEAD_DIM 256

typedef enum {
  T3D_ATTN_FLOAT32 = 0,
  T3D_ATTN_BFLOAT16 = 1 /* stored as uint16_t bits; computed in float32 */
} t3d_attn_dtype_t;

typedef enum {
  T3D_ATTN_ISA_AUTO = 0, /* best available, unless T3D_ATTN_ISA=scalar|avx2|avx512|amx names another */
  T3D_ATTN_ISA_SCALAR = 1,
  T3D_ATTN_ISA_AVX2 = 2,   /* AVX2 + FMA */
  T3D_ATTN_ISA_AVX512 = 3, /* AVX-512 F/BW/VL, plus vdpbf16ps for bfloat16 inputs where the CPU has AVX512_BF16 */
  T3D_ATTN_ISA_AMX = 4     /* bfloat16 on AMX-BF16 tiles (needs AVX512_BF16 too and the OS's tile permission, asked
                              once); float32 under it runs the AVX-512 path */
} t3d_attn_isa_t;

/* A parallel-for supplied by the caller (e.g. a wrapper around at::parallel_for): it must call body(arg, begin, end)
 * over disjoint ranges covering [0, n), from any threads, and return when all have finished. */
typedef void (*t3d_attn_body_fn)(void *arg, int64_t begin, int64_t end);
typedef void (*t3d_attn_parallel_for_fn)(void *ctx, int64_t n, t3d_attn_body_fn body, void *arg);

/* How to run. NULL means all defaults. */
typedef struct t3d_attn_exec {
  t3d_attn_parallel_for_fn parallel_for; /* NULL: the kernel starts its own pthreads */
  void *parallel_ctx;                    /* passed back as parallel_for's ctx */
  int nthreads;       /* threads of the internal split, and work-splitting hint for parallel_for; 0 = online cores */
  t3d_attn_isa_t isa; /* T3D_ATTN_ISA_AUTO unless a test forces a path */
} t3d_attn_exec_t;

/* out[b,h,i,:] = softmax_j(scale * q_i . k_j) v_j over keys visible to query i; query i sits at global position
 * q_start + i, key j at k_start + j; with causal a key is visible when its position <= the query's.
 * q, out: [batch, q_heads, seq_q, head_dim] (dtype); k, v: [batch, kv_heads, seq_k, head_dim] (dtype);
 * lse: float32 [batch, q_heads, seq_q] = log sum_j exp(scale q_i . k_j), -inf (and out row 0) when no key is visible.
 * scale NAN or <= 0 means 1/sqrt(head_dim). q head h reads kv head h / (q_heads / kv_heads). seq_q or seq_k may be
 * 0 (seq_k == 0 gives out 0, lse -inf). */
int t3d_attn_forward(t3d_attn_dtype_t dtype, const void *q, const void *k, const void *v, void *out, float *lse,
                     int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t seq_q, int64_t seq_k,
                     int64_t head_dim, int causal, float scale, int64_t q_start, int64_t k_start,
                     const t3d_attn_exec_t *exec);

/* Gradients of t3d_attn_forward. dout, out, dq like q; dk, dv like k (summed over the q heads of a kv head); lse as
 * forward returned it. Accumulation in float32; dq/dk/dv written in dtype (every element, zeros included). */
int t3d_attn_backward(t3d_attn_dtype_t dtype, const void *dout, const void *q, const void *k, const void *v,
                      const void *out, const float *lse, void *dq, void *dk, void *dv, int64_t batch,
                      int64_t q_heads, int64_t kv_heads, int64_t seq_q, int64_t seq_k, int64_t head_dim, int causal,
                      float scale, int64_t q_start, int64_t k_start, const t3d_attn_exec_t *exec);

/* In place, float32 arithmetic, per row r of rows (= batch * heads * seq):
 *   new = logaddexp(lse[r], block_lse[r]); out[r,:] = out[r,:] e^(lse[r]-new) + block_out[r,:] e^(block_lse[r]-new)
 * A -inf block_lse leaves the row untouched; a -inf lse takes the block's row. out_dtype and block_dtype may differ. */
int t3d_attn_merge(t3d_attn_dtype_t out_dtype, void *out, float *lse, t3d_attn_dtype_t block_dtype,
                   const void *block_out, const float *block_lse, int64_t rows, int64_t head_dim,
                   const t3d_attn_exec_t *exec);

/* The path AUTO resolves to now (after T3D_ATTN_ISA), and whether a path can run here. */
t3d_attn_isa_t t3d_attn_isa_selected(void);
int t3d_attn_isa_available(t3d_attn_isa_t isa);
/* "scalar", "avx2", "avx512", "amx", "auto", or "unknown". Static, never NULL. */
const char *t3d_attn_isa_name(t3d_attn_isa_t isa);
/* Names the path t3d_attn_forward takes for dtype under isa: "avx512-bf16" (AVX-512 with vdpbf16ps) for bfloat16
 * under T3D_ATTN_BF16DOT=1, "avx512" for float32 under AMX, else the ISA's name. */
const char *t3d_attn_isa_describe(t3d_attn_isa_t isa, t3d_attn_dtype_t dtype);

#ifdef __cplusplus
}
#endif
#endif /* T3D_ATTN_H */
