/* base/params.h: libt3d's registry of the environment variables t3d reads (base/params.def declares them; the
 * public listing is t3d_param_count / t3d_param_get / t3d_param_find in t3d.h). Not installed.
 *
 * The registry reads the environment once, at the first call of any function below or of the public listing
 * (pthread_once), copies every value and keeps it, with whether the user set it, for the life of the process. The
 * integers are parsed exactly as t3d__env_int parses them (common.c): strtoll with base 0, empty text counts as
 * unset, text that is not a whole integer gives the default (and a warning when that variable is first read
 * through t3d__param_int or listed). What a negative value means stays with the caller.
 *
 * Reading never logs from t3d__param_str and t3d__param_is_set, so that the logger's own setup (common.c's
 * log_init, which runs inside a pthread_once) may use them; t3d__param_int may warn, so the logger must not.
 *
 * ---- Call sites to switch (owner of the engine files, after merging) ----
 * Each line: the variable, where it is read today, and the call that replaces the read. The behaviour is the same
 * except that the value is read once per process instead of at every call.
 *
 *   T3D_DEBUG                   common.c:61   t3d__env_str("T3D_DEBUG", "")  -> t3d__param_str(T3D_PARAM_DEBUG)
 *                               (default "", never NULL)
 *   T3D_DEBUG_FILE              common.c:67   t3d__param_str(T3D_PARAM_DEBUG_FILE) (NULL when unset)
 *   T3D_SPIN_NS                 comm.c:95     budget()'s t3d__env_int(env, dflt): pass an id instead of (env, dflt),
 *                                             t3d__param_int(id); its callers comm.c:141, :145, :152
 *                                             (budget(&spin_ns / &running_spin_ns, T3D_PARAM_SPIN_NS))
 *                               comm.c:110    t3d__env_str("T3D_SPIN_NS", NULL) == NULL
 *                                             -> !t3d__param_is_set(T3D_PARAM_SPIN_NS)
 *   T3D_YIELD_NS                comm.c:132    budget(&yield_ns, T3D_PARAM_YIELD_NS)
 *                               comm.c:113    -> !t3d__param_is_set(T3D_PARAM_YIELD_NS)
 *   T3D_YIELD_NS_OVERSUBSCRIBED comm.c:114    t3d__param_int(T3D_PARAM_YIELD_NS_OVERSUBSCRIBED)
 *   T3D_SHM_P2P                 comm.c:999    t3d__param_int(T3D_PARAM_SHM_P2P) == 0
 *                               shm/shm.c:70  t3d__param_int(T3D_PARAM_SHM_P2P) != 0
 *   T3D_TIMEOUT_MS              comm.c:1053   t3d__param_int(T3D_PARAM_TIMEOUT_MS)
 *   T3D_INLINE_BYTES            comm.c:1056   t3d__param_int(T3D_PARAM_INLINE_BYTES)
 *   T3D_INLINE_WAIT_NS          comm.c:1058   t3d__param_int(T3D_PARAM_INLINE_WAIT_NS)
 *   T3D_TRANSPORT               comm.c:1061   t3d__param_str(T3D_PARAM_TRANSPORT) (default "auto")
 *   T3D_SHM_DIRECT_BYTES        shm/shm.c:101 t3d__param_int(T3D_PARAM_SHM_DIRECT_BYTES)
 *                               shm/shm.c:103 t3d__param_is_set(T3D_PARAM_SHM_DIRECT_BYTES)
 *   T3D_SHM_DIRECT_MAX_BYTES    shm/shm.c:102 t3d__param_int(T3D_PARAM_SHM_DIRECT_MAX_BYTES)
 *   T3D_SHM_ONESHOT_BYTES       shm/shm.c:220 t3d__param_int(T3D_PARAM_SHM_ONESHOT_BYTES)
 *   T3D_SHM_CHUNK_BYTES         shm/shm.c:223 t3d__param_int(T3D_PARAM_SHM_CHUNK_BYTES)
 *   T3D_SHM_NT_BYTES            shm/shm.c:225 t3d__param_int(T3D_PARAM_SHM_NT_BYTES)
 *   T3D_SHM_BYTES               shm/shm.c:260 t3d__param_int(T3D_PARAM_SHM_BYTES)
 *   T3D_SHM_P2P_EAGER_BYTES     shm/p2p.c:143 t3d__param_int(T3D_PARAM_SHM_P2P_EAGER_BYTES)
 *   T3D_ALGO_SMALL_BYTES        algo/ring.c:66 t3d__param_int(T3D_PARAM_ALGO_SMALL_BYTES) (its own cache, ring.c:62-71,
 *                                             can go: the registry caches)
 *   T3D_UCX_ERR_MODE            transport/ucx.c:128 t3d__param_str(T3D_PARAM_UCX_ERR_MODE) (default "none")
 *   T3D_NCCL_LIBRARY            nccl/nccl_load.c:29 t3d__param_str(T3D_PARAM_NCCL_LIBRARY) (default "libnccl.so.2")
 * Then t3d__env_int / t3d__env_str (common.c:38-53, t3d_internal.h:41-43) have no caller left and can go. The
 * defaults that the code also names must keep the registry's values: DEFAULT_RANK_BYTES (shm/shm.c:21, for
 * T3D_SHM_BYTES <= 0), T3D_SHM_DIRECT_MIN_DEFAULT and T3D_SHM_DIRECT_MAX_DEFAULT (shm/shm.h:218-219);
 * tests/python/test_params.py pins every default to the value the code had.
 *
 * Tests that change these variables inside one process must call t3d__param_reload() after their setenv/unsetenv
 * once the call sites read the registry: tests/c/test_comm.cc:187 and :191 (T3D_SHM_P2P, T3D_SHM_BYTES per case),
 * :417, :488, :497-498, :528-529 (T3D_INLINE_WAIT_NS, T3D_SHM_DIRECT_BYTES), tests/c/test_nccl.cc:44
 * (T3D_NCCL_LIBRARY, set before the first load).
 *
 * Read elsewhere, and declared here with their reader: T3D_CUDA_BLOCKING_WAIT (shim/work_t3d.cpp, through
 * t3d_param_find), T3D_ATTN_ISA and T3D_ATTN_BF16DOT (kernels/attn_cpu.c, getenv on every call on purpose),
 * T3D_AUTOLOAD (python/t3d_autoload.py), T3D_AUTO_INTEGRATIONS (python/t3d/_backend.py), T3D_MODEL_CACHE
 * (python/t3d/train/model.py). tests/python/test_params.py fails when a T3D_* variable read anywhere in c_src,
 * kernels, shim or python is missing from params.def. */
#ifndef T3D_BASE_PARAMS_H
#define T3D_BASE_PARAMS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" { /* tests/c/test_params.cc */
#endif

/* T3D_PARAM_DEBUG, T3D_PARAM_SHM_BYTES, ... in params.def's order; T3D_PARAM_ID_COUNT is their number. */
typedef enum t3d_param_id {
#define T3D_PARAM(id, name, type, int_default, str_default, shown_default, reader, meaning) T3D_PARAM_##id,
#include "params.def"
#undef T3D_PARAM
  T3D_PARAM_ID_COUNT
} t3d_param_id_t;

/* INT and BOOL parameters: the effective value (the default when unset, empty or not an integer). 0 for a STR
 * parameter or an id out of range. */
int64_t t3d__param_int(t3d_param_id_t id);
/* STR parameters: the environment's text when set (non-empty), else the default, which may be NULL (T3D_DEBUG_FILE,
 * T3D_ATTN_ISA, T3D_MODEL_CACHE). INT and BOOL parameters: the effective value in decimal. NULL for an id out of
 * range. Valid for the life of the process. */
const char *t3d__param_str(t3d_param_id_t id);
/* 1 when the environment sets the variable to non-empty text (valid or not): "the user chose a value". */
int t3d__param_is_set(t3d_param_id_t id);
/* Reads the environment again (for tests that setenv inside one process). Values read before stay valid; a call
 * running at the same time sees either the old values or the new ones, each variable whole. */
void t3d__param_reload(void);

#ifdef __cplusplus
}
#endif
#endif /* T3D_BASE_PARAMS_H */
