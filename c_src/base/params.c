/* base/params.c: the registry of the environment variables t3d reads (base/params.def), behind base/params.h's
 * internal getters and t3d.h's public listing.
 *
 * One reading of the environment is a snapshot: a copy of every variable's text and its parsed value. The first use
 * of the registry takes one (pthread_once) and publishes it; t3d__param_reload takes another and publishes it in
 * place of the first, and keeps the first reachable from it. A snapshot is never changed once published and never
 * freed (a process that never reloads has one; a test, a handful), so the strings handed out stay valid for the
 * life of the process and a reader needs no lock. Taking a snapshot never logs (see params.h: the logger's setup
 * may read the registry). */
#include "params.h"

#include "t3d_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What params.def declares about one variable. */
typedef struct param_def {
  const char *name;
  t3d_param_type_t type;
  int64_t int_default;     /* INT, BOOL */
  const char *str_default; /* STR; may be NULL */
  const char *shown_default;
  const char *reader;
  const char *meaning;
} param_def_t;

/* The name of id X is "T3D_X": the README and the enum must not drift apart (the test compares the text, this the
 * length, at compile time). */
#define T3D_PARAM(id, name, type, int_default, str_default, shown_default, reader, meaning) \
  _Static_assert(sizeof(name) == sizeof("T3D_" #id), name ": the name of T3D_PARAM_" #id " must be T3D_" #id);
#include "params.def"
#undef T3D_PARAM

static const param_def_t defs[T3D_PARAM_ID_COUNT] = {
#define T3D_PARAM(id, name, type, int_default, str_default, shown_default, reader, meaning) \
  [T3D_PARAM_##id] = {name, T3D_PARAM_TYPE_##type, int_default, str_default, shown_default, reader, meaning},
#include "params.def"
#undef T3D_PARAM
};

/* One variable in one snapshot. */
typedef struct param_value {
  const char *env;  /* a copy of the environment's text; NULL when unset or empty */
  const char *text; /* the effective value as text: STR, env or the default (may be NULL); INT and BOOL, digits */
  int64_t num;      /* INT and BOOL: the effective value */
  int valid;        /* 0: env is set but is not an integer, so the default holds */
  char digits[24];  /* INT and BOOL: num in decimal */
} param_value_t;

typedef struct snapshot {
  param_value_t v[T3D_PARAM_ID_COUNT];
  struct snapshot *older; /* the reading this one replaced: kept reachable, as its strings may still be in use */
} snapshot_t;

static snapshot_t first;               /* the first reading: static, so that it cannot fail to allocate */
static _Atomic(snapshot_t *) current;  /* the published reading */
static pthread_once_t first_once = PTHREAD_ONCE_INIT;
static char default_digits[T3D_PARAM_ID_COUNT][24]; /* INT and BOOL defaults as text, set with the first reading */
static pthread_mutex_t reload_mu = PTHREAD_MUTEX_INITIALIZER; /* one reload at a time */

/* The parse (the logger warns about invalid text when it starts, common.c): strtoll with base 0, so "0x10" is 16 and "010" is 8; no
 * unit suffixes; leading white space is skipped (strtoll's rule), anything left after the digits makes the whole
 * text invalid. Returns 0 (and *out = dflt) for invalid text. */
static int parse_int(const char *s, int64_t dflt, int64_t *out) {
  char *end = NULL;
  long long v = strtoll(s, &end, 0);
  if (end == s || *end != '\0') {
    *out = dflt;
    return 0;
  }
  *out = (int64_t)v;
  return 1;
}

/* Reads variable i of the environment into v (a zeroed slot). */
static void read_one(int i, param_value_t *v) {
  const param_def_t *d = &defs[i];
  const char *s = getenv(d->name);
  if (s != NULL && *s != '\0') {
    /* A copy: a later setenv may free the environment's string. Without memory for it, the environment's own
     * string serves, which holds as long as nobody changes that variable. */
    char *copy = strdup(s);
    v->env = copy != NULL ? copy : s;
  }
  v->valid = 1;
  if (d->type == T3D_PARAM_TYPE_STR) {
    v->text = v->env != NULL ? v->env : d->str_default;
    return;
  }
  v->num = d->int_default;
  if (v->env != NULL) v->valid = parse_int(v->env, d->int_default, &v->num);
  snprintf(v->digits, sizeof v->digits, "%lld", (long long)v->num);
  v->text = v->digits;
}

static void read_all(snapshot_t *s) {
  for (int i = 0; i < T3D_PARAM_ID_COUNT; i++) read_one(i, &s->v[i]);
}

static void read_first(void) {
  for (int i = 0; i < T3D_PARAM_ID_COUNT; i++) {
    snprintf(default_digits[i], sizeof default_digits[i], "%lld", (long long)defs[i].int_default);
  }
  read_all(&first);
  atomic_store_explicit(&current, &first, memory_order_release);
}

static snapshot_t *snap(void) {
  pthread_once(&first_once, read_first);
  return atomic_load_explicit(&current, memory_order_acquire);
}

static int valid_id(t3d_param_id_t id) { return (int)id >= 0 && (int)id < T3D_PARAM_ID_COUNT; }

int64_t t3d__param_int(t3d_param_id_t id) {
  if (!valid_id(id) || defs[id].type == T3D_PARAM_TYPE_STR) return 0;
  return snap()->v[id].num;
}

const char *t3d__param_str(t3d_param_id_t id) {
  if (!valid_id(id)) return NULL;
  return snap()->v[id].text;
}

int t3d__param_is_set(t3d_param_id_t id) {
  if (!valid_id(id)) return 0;
  return snap()->v[id].env != NULL;
}

void t3d__param_reload(void) {
  snap(); /* the first reading comes first, so that it cannot overwrite this one */
  snapshot_t *s = calloc(1, sizeof *s);
  if (s == NULL) return; /* the values already read stay */
  pthread_mutex_lock(&reload_mu);
  read_all(s);
  s->older = atomic_load_explicit(&current, memory_order_relaxed);
  atomic_store_explicit(&current, s, memory_order_release);
  pthread_mutex_unlock(&reload_mu);
}

/* ---------- the public listing (t3d.h) ---------- */

int t3d_param_count(void) { return T3D_PARAM_ID_COUNT; }

t3d_result_t t3d_param_get(int index, t3d_param_t *out) {
  if (index < 0 || index >= T3D_PARAM_ID_COUNT || out == NULL) return T3D_ERR_INVALID_ARG;
  const param_def_t *d = &defs[index];
  param_value_t *v = &snap()->v[index];
  int is_str = d->type == T3D_PARAM_TYPE_STR;
  memset(out, 0, sizeof *out);
  out->name = d->name;
  out->type = d->type;
  out->reader = d->reader;
  out->meaning = d->meaning;
  out->default_text = is_str ? (d->str_default != NULL ? d->str_default : "") : default_digits[index];
  out->default_shown = d->shown_default;
  out->value_text = v->text != NULL ? v->text : "";
  out->value = is_str ? 0 : v->num;
  out->env_text = v->env;
  out->is_set = v->env != NULL;
  out->is_valid = v->valid;
  return T3D_OK;
}

t3d_result_t t3d_param_find(const char *name, t3d_param_t *out) {
  if (name == NULL) return T3D_ERR_INVALID_ARG;
  for (int i = 0; i < T3D_PARAM_ID_COUNT; i++) {
    if (strcmp(defs[i].name, name) == 0) return t3d_param_get(i, out);
  }
  return T3D_ERR_INVALID_ARG;
}
