/* base/params.h: libt3d's registry of the environment variables t3d reads (base/params.def declares them; the
 * public listing is t3d_param_count / t3d_param_get / t3d_param_find in t3d.h). Not installed.
 *
 * The registry reads the environment once, at the first call of any function below or of the public listing
 * (pthread_once), copies every value and keeps it, with whether the user set it, for the life of the process. The
 * integers are parsed with strtoll, base 0; empty text counts as unset, text that is not a whole integer gives the
 * default. What a negative value means stays with the caller.
 *
 * The registry never logs: the logger reads it (common.c's log_init, T3D_DEBUG and T3D_DEBUG_FILE) and reports
 * the values that are not integers when it starts.
 *
 * Every libt3d read of the environment goes through these functions (tests/python/test_params.py scans the
 * sources); a test that changes a variable inside one process calls t3d__param_reload() after its setenv.
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
