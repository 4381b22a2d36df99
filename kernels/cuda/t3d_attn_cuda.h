/* t3d_attn_cuda.h: CUDA attention kernels with the contract of t3d_attn.h (forward with online softmax, backward,
 * log-sum-exp merge). Plain C interface, no torch: the caller passes device pointers and a cudaStream_t (as void*). */
#ifndef T3D_ATTN_CUDA_H
#define T3D_ATTN_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dtype: 0 = float32, 1 = bfloat16 (the values of t3d_attn_dtype_t), 2 = float16 (CUDA only: the CPU kernels take
 * float16 through float32 copies made by the shim). Layout [batch, heads, seq, head_dim],
 * contiguous; lse float32 [batch, q_heads, seq_q]. scale NAN or <= 0 means 1/sqrt(head_dim). head_dim in [1, 256].
 * Return 0 on success, -1 on a bad argument, or a positive cudaError_t from the launch. Asynchronous on stream. */
int t3d_attn_cuda_forward(int dtype, const void *q, const void *k, const void *v, void *out, float *lse,
                          int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t seq_q, int64_t seq_k,
                          int64_t head_dim, int causal, float scale, int64_t q_start, int64_t k_start, void *stream);

/* Gradients; dq like q, dk/dv like k (summed over the q heads of a kv head), every element written. `workspace`
 * is float32 scratch of batch * q_heads * seq_q elements (row-wise dout . out). */
int t3d_attn_cuda_backward(int dtype, const void *dout, const void *q, const void *k, const void *v, const void *out,
                           const float *lse, void *dq, void *dk, void *dv, float *workspace, int64_t batch,
                           int64_t q_heads, int64_t kv_heads, int64_t seq_q, int64_t seq_k, int64_t head_dim,
                           int causal, float scale, int64_t q_start, int64_t k_start, void *stream);

/* In-place merge of (block_out, block_lse) into (out, lse), float32 arithmetic; out_dtype and block_dtype may
 * differ. rows = batch * heads * seq. */
int t3d_attn_cuda_merge(int out_dtype, void *out, float *lse, int block_dtype, const void *block_out,
                        const float *block_lse, int64_t rows, int64_t head_dim, void *stream);

/* cudaGetErrorString for a positive code from the functions above. */
const char *t3d_attn_cuda_error_string(int code);

#ifdef __cplusplus
}
#endif
#endif /* T3D_ATTN_CUDA_H */
