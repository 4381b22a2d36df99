/* t3d.h: the public C API of t3d: communicators, non-blocking collectives and point-to-point over requests.
 * C11, no torch. Every function returns t3d_result_t; the communicator keeps the text of its last error. */
#ifndef T3D_H
#define T3D_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define T3D_VERSION_MAJOR 0
#define T3D_VERSION_MINOR 1
#define T3D_VERSION_PATCH 0

typedef enum t3d_result {
  T3D_OK = 0,
  T3D_IN_PROGRESS = 1,
  T3D_ERR_INVALID_ARG = -1,
  T3D_ERR_TIMEOUT = -2,
  T3D_ERR_PEER_LOST = -3,
  T3D_ERR_ABORTED = -4,
  T3D_ERR_MISMATCH = -5,
  T3D_ERR_NO_MEMORY = -6,
  T3D_ERR_UNSUPPORTED = -7,
  T3D_ERR_SYSTEM = -8,
  T3D_ERR_TRANSPORT = -9,
  T3D_ERR_INTERNAL = -10
} t3d_result_t;

/* Static, never NULL: "T3D_OK", "T3D_ERR_TIMEOUT", ... */
const char *t3d_result_string(t3d_result_t res);

typedef enum t3d_dtype {
  T3D_INT8 = 0,
  T3D_UINT8,
  T3D_INT32,
  T3D_INT64,
  T3D_FLOAT16,
  T3D_BFLOAT16,
  T3D_FLOAT32,
  T3D_FLOAT64,
  T3D_BOOL,       /* one byte, 0 or 1 */
  T3D_COMPLEX64,  /* pairs of float32; only SUM, AVG and PREMUL_SUM (real scalar) reduce it */
  T3D_COMPLEX128, /* pairs of float64; same ops as COMPLEX64 */
  T3D_DTYPE_COUNT
} t3d_dtype_t;

typedef enum t3d_redop {
  T3D_SUM = 0,
  T3D_PROD,
  T3D_MIN,
  T3D_MAX,
  T3D_AVG,        /* sum divided by the group size; integers divide with truncation */
  T3D_PREMUL_SUM, /* each rank's input multiplied by opts->premul_scalar, then summed */
  T3D_BAND,       /* integers and bool only */
  T3D_BOR,
  T3D_BXOR,
  T3D_REDOP_COUNT
} t3d_redop_t;

size_t t3d_dtype_size(t3d_dtype_t dtype); /* 0 for an invalid dtype */
const char *t3d_dtype_name(t3d_dtype_t dtype);
const char *t3d_redop_name(t3d_redop_t op);
/* T3D_OK when op can reduce dtype; T3D_ERR_UNSUPPORTED (e.g. BAND on float) or T3D_ERR_INVALID_ARG otherwise. */
t3d_result_t t3d_redop_supported(t3d_redop_t op, t3d_dtype_t dtype);

/* Bootstrap key-value store. t3d calls it only from t3d_comm_init / t3d_comm_split, on the caller's thread.
 * get blocks until the key exists or timeout_ms passes (then T3D_ERR_TIMEOUT). On success *value is allocated with
 * malloc() and t3d releases it with free(). The store must outlive every communicator made from it. */
typedef struct t3d_store {
  void *ctx;
  t3d_result_t (*set)(void *ctx, const char *key, const void *value, size_t len);
  t3d_result_t (*get)(void *ctx, const char *key, void **value, size_t *len, int64_t timeout_ms);
} t3d_store_t;

typedef struct t3d_config {
  int64_t timeout_ms;     /* default per-operation timeout; <= 0: T3D_TIMEOUT_MS or 600000 */
  const char *name;       /* group name used in messages, e.g. "world" or "tp"; NULL: "comm" */
  const char *key_prefix; /* namespace of this communicator's keys in the store; NULL: "t3d" */
  const char *transport;  /* NULL: T3D_TRANSPORT or "auto" */
  /* A same-host allreduce, broadcast, allgather or reduce_scatter of at most this many bytes (and any barrier)
   * starts on the calling thread when the communicator is idle, and finishes there when the peers arrive within T3D_INLINE_WAIT_NS
   * (default 20 us); otherwise the progress thread finishes it. This saves two thread hand-offs per small call; calls stay non-blocking. -1: never;
   * T3D_INLINE_DEFAULT: T3D_INLINE_BYTES, else 65536. Splits inherit the parent's value unless they set their own. */
  int64_t inline_bytes;
} t3d_config_t;

#define T3D_INLINE_DEFAULT (-2)

/* Fills the defaults above. */
void t3d_config_init(t3d_config_t *cfg);

/* Where a call's buffers live. */
typedef enum t3d_memtype {
  T3D_MEM_HOST = 0, /* host memory: shared memory between ranks of a host, UCX otherwise */
  T3D_MEM_CUDA = 1  /* device memory of one CUDA device: through NCCL (libnccl.so.2, loaded at the first such call),
                     * or staged through host memory where ranks of the group share a device (T3D_CUDA_PATH) */
} t3d_memtype_t;

/* Per-call options; pass NULL for the defaults. A zeroed struct is the defaults too. */
typedef struct t3d_opts {
  int64_t timeout_ms;   /* <= 0: the communicator's timeout */
  double premul_scalar; /* factor of T3D_PREMUL_SUM */
  unsigned flags;       /* T3D_FLAG_* */
  /* T3D_MEM_CUDA: the buffers are on CUDA device `device`, which must be the calling thread's current device, and
   * the operation is enqueued on `stream` (a cudaStream_t; NULL is the legacy default stream). Such a request
   * completes as soon as NCCL has enqueued it: the data is ready in stream order, and a failure on the device shows
   * in t3d_comm_status. The first CUDA collective of a communicator creates its NCCL communicator, a collective
   * over all its ranks (rank 0 puts NCCL's unique id in the store); a send or receive outside a group uses its own
   * two-rank NCCL communicator, so it needs only its peer. Tags are ignored and T3D_ANY_SOURCE is not supported,
   * as in NCCL; a communicator serves one CUDA device; barriers always run on the host.
   * Ranks that share a device (NCCL refuses them) are found at the first CUDA call (each rank publishes its device's
   * PCI bus id in the store) and staged instead: the input is copied to host memory on `stream`, the host path runs
   * the operation, the result is copied back on `stream`, and the request completes once that copy has finished
   * (a send: once its bytes are on the host and posted). Every dtype and op of the host path then works. */
  t3d_memtype_t memtype;
  int device;
  void *stream;
} t3d_opts_t;

/* t3d_recv: a message longer than the buffer fills it and the rest is dropped (not an error);
 * t3d_request_count then reports the sender's count, larger than the posted one. */
#define T3D_FLAG_RECV_TRUNCATE 1u
/* A collective whose caller waits for it right after the call (a blocking call, as MPI_Allreduce is to
 * MPI_Iallreduce). On host buffers over shared memory, with nothing queued before it, the call runs the whole
 * collective on the calling thread, waiting for late peers up to its timeout, and returns a finished request:
 * no hand-off to the progress thread and back, and the buffers stay in this core's caches. Without the flag only
 * small collectives start on the calling thread, and go on in the background when peers are late. Ignored inside a
 * group, for CUDA buffers, and for point-to-point. */
#define T3D_FLAG_BLOCKING 2u

typedef struct t3d_comm t3d_comm_t;
typedef struct t3d_request t3d_request_t;

#define T3D_ANY_SOURCE (-1)
#define T3D_SPLIT_NOCOLOR (-1)
#define T3D_MAX_TAG ((int64_t)0x3fffffff)

/* Collective over the `size` callers that share store and cfg->key_prefix. */
t3d_result_t t3d_comm_init(t3d_comm_t **comm, int rank, int size, const t3d_store_t *store,
                           const t3d_config_t *cfg);
/* Collective over parent. Ranks with the same color form a new communicator ordered by (key, parent rank);
 * color T3D_SPLIT_NOCOLOR gets *newcomm = NULL. cfg may be NULL (parent's timeout, name "split"). */
t3d_result_t t3d_comm_split(t3d_comm_t *parent, int color, int key, const t3d_config_t *cfg,
                            t3d_comm_t **newcomm);
/* Finishes queued operations, then frees everything. Not collective. */
t3d_result_t t3d_comm_destroy(t3d_comm_t *comm);
/* Any thread, any time: every pending and later request completes with T3D_ERR_ABORTED. Destroy still needed. */
t3d_result_t t3d_comm_abort(t3d_comm_t *comm);
int t3d_comm_rank(const t3d_comm_t *comm);
int t3d_comm_size(const t3d_comm_t *comm);
/* T3D_OK, or the error that broke the communicator (timeout, lost peer, abort). */
t3d_result_t t3d_comm_status(t3d_comm_t *comm);
/* Text of the last error on this communicator ("" if none). Valid until the next call that fails. */
const char *t3d_comm_last_error(t3d_comm_t *comm);
const char *t3d_comm_transport(const t3d_comm_t *comm);
/* Text of the last error recorded on the calling thread, by any communicator or by a t3d_comm_init that failed. */
const char *t3d_thread_last_error(void);
/* One step of t3d's waiting policy, for a caller's own poll loop (the torch shim's Work::wait): spins or yields once
 * and returns 0 while polling is still worth it, 1 once the caller should block instead. *since is 0 before the
 * first call. The policy: spin ~5 us (T3D_SPIN_NS; not when this host runs as many ranks of a communicator as the
 * process may use cores), then yield for 2 ms (T3D_YIELD_NS; 200 us, T3D_YIELD_NS_OVERSUBSCRIBED, with more ranks
 * than cores, where every poller takes turns from the ranks that have work). */
int t3d_backoff_poll(uint64_t *since);
/* t3d_backoff_poll for a thread waiting on req: also runs the progress req needs (same-host point-to-point is
 * progressed by its waiters, not by a background thread) and, for such a request, never asks the caller to block
 * (it naps ~20 us instead once past the yield phase). Returns 1 when req is done or the caller should block. */
int t3d_request_poll(t3d_request_t *req, uint64_t *since);

/* Registered memory: host memory that the other ranks of this host can map (a memfd per allocation, page
 * aligned). An allreduce, reduce_scatter, allgather, alltoall or broadcast of equal blocks of at least
 * T3D_SHM_MAPPED_BYTES whose buffers are in it on every rank of a same-host group reads and writes the peers'
 * buffers in place (one copy) instead of copying through the shared segment. Each allocation holds one file
 * descriptor until freed. T3D_ERR_INVALID_ARG for 0 bytes or a pointer t3d_mem_alloc did not return. */
t3d_result_t t3d_mem_alloc(size_t bytes, void **ptr);
t3d_result_t t3d_mem_free(void *ptr);
/* In a child of fork() the allocations it inherited are its own copies (copy on write from the parent's pages; a
 * page the child has not written still shows the parent's later writes), as ordinary memory would be apart from
 * that, and they no longer count as t3d memory (t3d_mem_owns: 0; t3d_mem_free still frees them). */
/* 1 when [ptr, ptr + bytes) lies in one live t3d_mem_alloc allocation of this process. */
int t3d_mem_owns(const void *ptr, size_t bytes);
/* memcpy with the non-temporal stores the collectives use for large buffers (where the CPU has AVX-512 or AVX;
 * memmove otherwise); dst == src rewrites the buffer in place. What benchmarks measure the machine's copy bandwidth
 * with. */
void t3d_copy_stream(void *dst, const void *src, size_t bytes);

/* Collectives. Counts are in elements of dtype. sendbuf == recvbuf means in place. Buffers must stay valid until the
 * request completes; count/displacement arrays are copied at call time. */
t3d_result_t t3d_allreduce(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                           t3d_redop_t op, const t3d_opts_t *opts, t3d_request_t **req);
t3d_result_t t3d_broadcast(t3d_comm_t *comm, void *buf, size_t count, t3d_dtype_t dtype, int root,
                           const t3d_opts_t *opts, t3d_request_t **req);
/* recvbuf is written at root only (may be NULL elsewhere). */
t3d_result_t t3d_reduce(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                        t3d_redop_t op, int root, const t3d_opts_t *opts, t3d_request_t **req);
/* recvbuf holds size*count elements, rank r's block at r*count. */
t3d_result_t t3d_allgather(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                           const t3d_opts_t *opts, t3d_request_t **req);
/* Rank r contributes recvcounts[r] elements (sendcount must equal recvcounts[rank]) placed at displs[r]. */
t3d_result_t t3d_allgatherv(t3d_comm_t *comm, const void *sendbuf, size_t sendcount, void *recvbuf,
                            const size_t *recvcounts, const size_t *displs, t3d_dtype_t dtype,
                            const t3d_opts_t *opts, t3d_request_t **req);
/* At root recvbuf holds size*count elements; elsewhere it may be NULL. */
t3d_result_t t3d_gather(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                        int root, const t3d_opts_t *opts, t3d_request_t **req);
/* At root sendbuf holds size*count elements; elsewhere it may be NULL. */
t3d_result_t t3d_scatter(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                         int root, const t3d_opts_t *opts, t3d_request_t **req);
/* sendbuf holds size*recvcount elements; rank r receives the reduction of block r. */
t3d_result_t t3d_reduce_scatter(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t recvcount,
                                t3d_dtype_t dtype, t3d_redop_t op, const t3d_opts_t *opts, t3d_request_t **req);
/* sendbuf holds sum(recvcounts) elements, blocks laid out contiguously in rank order. */
t3d_result_t t3d_reduce_scatterv(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, const size_t *recvcounts,
                                 t3d_dtype_t dtype, t3d_redop_t op, const t3d_opts_t *opts, t3d_request_t **req);
/* Block r of sendbuf (count elements) goes to rank r. */
t3d_result_t t3d_alltoall(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                          const t3d_opts_t *opts, t3d_request_t **req);
/* Per-peer counts and displacements in elements; zeros allowed. */
t3d_result_t t3d_alltoallv(t3d_comm_t *comm, const void *sendbuf, const size_t *sendcounts, const size_t *sdispls,
                           void *recvbuf, const size_t *recvcounts, const size_t *rdispls, t3d_dtype_t dtype,
                           const t3d_opts_t *opts, t3d_request_t **req);
t3d_result_t t3d_barrier(t3d_comm_t *comm, const t3d_opts_t *opts, t3d_request_t **req);

/* Point-to-point. tag in [0, T3D_MAX_TAG]. A receive gets at most count elements; t3d_request_count says how many
 * arrived (more than count is T3D_ERR_MISMATCH, unless T3D_FLAG_RECV_TRUNCATE). peer T3D_ANY_SOURCE receives from
 * anyone. */
t3d_result_t t3d_send(t3d_comm_t *comm, const void *buf, size_t count, t3d_dtype_t dtype, int peer, int64_t tag,
                      const t3d_opts_t *opts, t3d_request_t **req);
t3d_result_t t3d_recv(t3d_comm_t *comm, void *buf, size_t count, t3d_dtype_t dtype, int peer, int64_t tag,
                      const t3d_opts_t *opts, t3d_request_t **req);
/* Blocking exchange, as MPI_Sendrecv: sends sendcount elements to dst and receives up to recvcount from src
 * (T3D_ANY_SOURCE too), both with tag, and returns once both are done: T3D_OK, or the error of the first that
 * failed (the communicator's last error says which). received (may be NULL): the elements that arrived. Between
 * ranks of one host it runs on the calling thread with no request on the heap; elsewhere it is a group of
 * t3d_send and t3d_recv, waited on. Not inside an open group. */
t3d_result_t t3d_sendrecv(t3d_comm_t *comm, const void *sendbuf, size_t sendcount, int dst, void *recvbuf,
                          size_t recvcount, int src, t3d_dtype_t dtype, int64_t tag, const t3d_opts_t *opts,
                          size_t *received);

/* Coalescing: operations issued between start and end are held and issued together at end (point-to-point first,
 * so any pairing of sends and receives inside a group cannot deadlock). Each keeps its own request; end can also
 * return one request that completes when all of them have (pass NULL if not wanted). Groups nest. */
t3d_result_t t3d_group_start(t3d_comm_t *comm);
t3d_result_t t3d_group_end(t3d_comm_t *comm, t3d_request_t **req);

/* T3D_OK when done, T3D_IN_PROGRESS, or the operation's error. Never blocks. */
t3d_result_t t3d_test(t3d_request_t *req);
/* Blocks until completion or timeout_ms (< 0: forever). A wait that times out returns T3D_ERR_TIMEOUT and leaves the
 * operation running. */
t3d_result_t t3d_wait(t3d_request_t *req, int64_t timeout_ms);
/* Text of the request's error ("" if none), naming the operation, its sequence number, group and ranks. */
const char *t3d_request_error(t3d_request_t *req);
/* Receives: the sender's rank and the number of elements that arrived. */
int t3d_request_source(t3d_request_t *req);
size_t t3d_request_count(t3d_request_t *req);
/* The provider that runs the operation: "shm" (same-host shared memory), "ucx" (the algorithms over UCX), "hier"
 * (shared memory inside hosts, UCX between them), "nccl" (CUDA buffers) or "cudev" (CUDA buffers of ranks that share
 * a device, staged through host memory); "" for a group. Chosen when the call is issued (docs/architecture.md, "Providers"). */
const char *t3d_request_provider(const t3d_request_t *req);
/* Called once, from t3d's progress thread, when the request completes (at once if already complete). It must not
 * block on another t3d request of the same communicator. */
typedef void (*t3d_callback_t)(void *arg, t3d_result_t result);
t3d_result_t t3d_request_set_callback(t3d_request_t *req, t3d_callback_t fn, void *arg);
/* Safe on a pending request: it is released once complete. A small collective that finished during its call
 * without error may hand out a request shared by all such calls (complete, T3D_OK), so two calls' handles may be
 * equal; each is freed as usual, which for that one does nothing. */
void t3d_request_free(t3d_request_t *req);

/* Library facts: "0.1.0"; the version of the UCX library loaded ("" in a build without UCX). */
const char *t3d_version_string(void);
const char *t3d_ucx_version_string(void);
/* What this build contains, as space-separated key=value words (more may come), e.g.
 * "ucx=1.13.1 shm=yes nccl=dlopen sanitize=no":
 *   ucx      the UCX headers it was built against, or "no" (T3D_WITH_UCX=OFF): then only groups whose ranks share a
 *            host and can use the shared-memory segment for everything work, others fail at t3d_comm_init
 *   shm      collectives and point-to-point through shared memory between the ranks of a host
 *   nccl     "dlopen": CUDA buffers through the NCCL loaded at run time (t3d_nccl_version_string)
 *   sanitize the -fsanitize list it was built with, or "no" */
const char *t3d_build_features(void);
/* The NCCL library that CUDA buffers would use ("2.27.5"), loading it if needed; "" when none can be loaded, and
 * then t3d_nccl_load_error() says why. T3D_NCCL_LIBRARY names the library file (default: libnccl.so.2, which in a
 * torch process is the copy torch loaded). */
const char *t3d_nccl_version_string(void);
const char *t3d_nccl_load_error(void);

/* ---------- device kernels for ranks that share a CUDA device ----------
 * With T3D_CUDA_PATH=ipc, collectives of ranks that share a device run on the device (c_src/cudev/ipc.c): buffers
 * exchanged through CUDA IPC, copies and reductions in stream order. libt3d holds no device code: the reductions
 * come from whoever registers them (t3d._C_cuda does when it loads); without them reducing collectives are staged.
 * reduce: dst[i] = srcs[0][i] op srcs[1][i] op ... for i < count, sources in order, half types accumulated in
 * float32; PREMUL_SUM multiplies every source by scalar first, AVG divides the sum by nsrc (integers truncating).
 * It only queues the work on stream (a cudaStream_t) and returns a cudaError_t (0: queued). reduce_supported says
 * which (dtype, op) pairs it handles (nonzero: yes). */
typedef struct t3d_cuda_kernels {
  int (*reduce_supported)(t3d_dtype_t dtype, t3d_redop_t op);
  int (*reduce)(void *dst, const void *const *srcs, int nsrc, size_t count, t3d_dtype_t dtype, t3d_redop_t op,
                double scalar, void *stream);
} t3d_cuda_kernels_t;
/* Registers the kernels for every communicator of the process (the struct is copied; NULL unregisters). */
void t3d_cuda_set_kernels(const t3d_cuda_kernels_t *kernels);

/* ---------- parameters: the environment variables t3d reads ----------
 * Every T3D_* variable that any part of t3d reads (libt3d, the torch shim, the attention kernels, the Python
 * package) is declared once in libt3d's registry, with its type, default, meaning and reader; these calls list them
 * with their effective values (`t3d.build_info()["params"]` and `python -m t3d` show the same). libt3d reads the
 * environment once, at the first use of any parameter, and keeps those values for the life of the process: a later
 * setenv() does not show here. Readers other than libt3d read the environment themselves (the attention kernels on
 * every call); for them this reports what the environment held when libt3d read it. */
typedef enum t3d_param_type {
  T3D_PARAM_TYPE_INT = 0, /* an integer: strtoll with base 0 (0x.. hex, 0.. octal), no K/M suffixes */
  T3D_PARAM_TYPE_STR = 1, /* text */
  T3D_PARAM_TYPE_BOOL = 2 /* an integer read as off (0) or on (anything else) */
} t3d_param_type_t;

/* One variable. Every string is static or lives as long as the process, never NULL unless said. */
typedef struct t3d_param {
  const char *name;          /* "T3D_SHM_BYTES" */
  t3d_param_type_t type;
  const char *reader;        /* who reads it: "libt3d", "shim", "kernels" or "python" */
  const char *meaning;       /* one line, Markdown */
  const char *default_text;  /* the value when unset, as text: "2097152", "auto"; "" when there is none */
  const char *default_shown; /* the default as the documentation shows it: "2 MiB", "stderr" */
  const char *value_text;    /* the effective value, as text (integers in decimal) */
  int64_t value;             /* INT and BOOL: the effective value; STR: 0 */
  const char *env_text;      /* what the environment held, when set (non-empty); else NULL */
  int is_set;                /* 1 when the environment sets it (non-empty), even to text that is not valid */
  int is_valid;              /* 0 when it is set to something its type cannot parse: the default holds then */
} t3d_param_t;

/* How many variables the registry declares; t3d_param_get takes 0 .. count - 1, in declaration order. */
int t3d_param_count(void);
/* T3D_ERR_INVALID_ARG when index is out of range or out is NULL. */
t3d_result_t t3d_param_get(int index, t3d_param_t *out);
/* By name ("T3D_CUDA_BLOCKING_WAIT"); T3D_ERR_INVALID_ARG when t3d declares no such variable. */
t3d_result_t t3d_param_find(const char *name, t3d_param_t *out);

#ifdef __cplusplus
}
#endif
#endif /* T3D_H */
