/* common.c: result strings, logging (T3D_DEBUG, T3D_DEBUG_FILE), clocks and message tags. */
#include "t3d_internal.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

const char *t3d_result_string(t3d_result_t res) {
  switch (res) {
    case T3D_OK: return "T3D_OK";
    case T3D_IN_PROGRESS: return "T3D_IN_PROGRESS";
    case T3D_ERR_INVALID_ARG: return "T3D_ERR_INVALID_ARG";
    case T3D_ERR_TIMEOUT: return "T3D_ERR_TIMEOUT";
    case T3D_ERR_PEER_LOST: return "T3D_ERR_PEER_LOST";
    case T3D_ERR_ABORTED: return "T3D_ERR_ABORTED";
    case T3D_ERR_MISMATCH: return "T3D_ERR_MISMATCH";
    case T3D_ERR_NO_MEMORY: return "T3D_ERR_NO_MEMORY";
    case T3D_ERR_UNSUPPORTED: return "T3D_ERR_UNSUPPORTED";
    case T3D_ERR_SYSTEM: return "T3D_ERR_SYSTEM";
    case T3D_ERR_TRANSPORT: return "T3D_ERR_TRANSPORT";
    case T3D_ERR_INTERNAL: return "T3D_ERR_INTERNAL";
  }
  return "T3D_ERR_UNKNOWN";
}

/* Same host = same host name and same boot: containers that share a name but not memory differ in boot id only
 * rarely, and a wrong guess fails at segment open with a clear error rather than silently. */
void t3d__host_identity(char *buf, size_t len) {
  char host[256] = "?", boot[64] = "";
  gethostname(host, sizeof host - 1);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f != NULL) {
    if (fgets(boot, sizeof boot, f) == NULL) boot[0] = '\0';
    fclose(f);
  }
  boot[strcspn(boot, "\n")] = '\0';
  snprintf(buf, len, "%s/%s", host, boot);
}

/* Kept a call also under link-time optimization, which otherwise inlines it where n is a constant, as `rep stos`
 * again (t3d_internal.h says why not): noipa stops that and the constant's propagation into a copy of it. */
#if defined(__has_attribute)
#if __has_attribute(noipa)
__attribute__((noipa))
#else
__attribute__((noinline))
#endif
#endif
void t3d__zero(void *p, size_t n) { memset(p, 0, n); }

/* membarrier(2)'s private expedited command, registered by each process (a child of fork() registers its own:
 * the registration belongs to the address space). Registering is idempotent, so threads may race to it. */
static _Atomic int membarrier_pid, membarrier_ok;

int t3d__membarrier_ready(void) {
  int me = (int)getpid();
  if (atomic_load(&membarrier_pid) != me) {
    atomic_store(&membarrier_ok, syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0);
    atomic_store(&membarrier_pid, me);
  }
  return atomic_load(&membarrier_ok);
}

int t3d__membarrier(void) {
  return t3d__membarrier_ready() && syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0 ? 0 : -1;
}

uint64_t t3d__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The level is read once: logging sits on hot paths and getenv is not free. */
static int log_level = -1;
static FILE *log_file;
static pthread_once_t log_once = PTHREAD_ONCE_INIT;

static void log_init(void) {
  const char *s = t3d__param_str(T3D_PARAM_DEBUG);
  int level = T3D_LOG_NONE;
  if (strcasecmp(s, "WARN") == 0) level = T3D_LOG_WARN;
  else if (strcasecmp(s, "INFO") == 0) level = T3D_LOG_INFO;
  else if (strcasecmp(s, "TRACE") == 0) level = T3D_LOG_TRACE;
  log_file = stderr;
  const char *path = t3d__param_str(T3D_PARAM_DEBUG_FILE);
  if (path != NULL) {
    char name[512];
    snprintf(name, sizeof name, "%s.%d", path, (int)getpid());
    FILE *f = fopen(name, "a");
    if (f != NULL) log_file = f;
  }
  __atomic_store_n(&log_level, level, __ATOMIC_RELEASE);
  /* The registry does not log (the logger reads it): a value that is not an integer is reported here, once. */
  for (int i = 0; i < t3d_param_count() && level >= T3D_LOG_WARN; i++) {
    t3d_param_t p;
    if (t3d_param_get(i, &p) == T3D_OK && !p.is_valid) {
      t3d__log(T3D_LOG_WARN, __FILE__, __LINE__, "ignoring %s=%s: not an integer", p.name, p.env_text);
    }
  }
}

int t3d__log_level(void) {
  int l = __atomic_load_n(&log_level, __ATOMIC_ACQUIRE);
  if (l >= 0) return l;
  pthread_once(&log_once, log_init);
  return __atomic_load_n(&log_level, __ATOMIC_ACQUIRE);
}

void t3d__log(int level, const char *file, int line, const char *fmt, ...) {
  static const char *names[] = {"", "WARN", "INFO", "TRACE"};
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const char *base = strrchr(file, '/');
  fprintf(log_file, "t3d %d %s %s:%d %s\n", (int)getpid(), names[level], base ? base + 1 : file, line, msg);
  fflush(log_file);
}

/* Tags: 2 bits kind | 26 bits | 20 bits step | 16 bits source. A collective's 26 bits are its operation (4 bits)
 * and sequence number (22 bits): ranks that run different collectives under one sequence number (a desync) then
 * never take each other's messages for their own, which would return wrong data quietly; a wait that lasts finds
 * the other operation's messages instead (ucx/xfer.c, look_for_desync) and tells the others (base/watch.h).
 * P2P user tags get 30 bits: the 26 plus the top 4 step bits, which collectives of kind P2P never use. */
uint64_t t3d__coll_tag(int op, uint64_t seq, uint32_t step, int src) {
  return (T3D_TAG_KIND_COLL << 62) | (((uint64_t)op << T3D_TAG_OP_SHIFT) & T3D_TAG_OP_MASK) |
         ((seq & 0x3fffffull) << 36) | (((uint64_t)step << T3D_TAG_SRC_BITS) & T3D_TAG_STEP_MASK) |
         ((uint64_t)src & T3D_TAG_SRC_MASK);
}

uint64_t t3d__p2p_tag(int64_t user_tag, int src) {
  return (T3D_TAG_KIND_P2P << 62) | (((uint64_t)user_tag & 0x3fffffffull) << 32) |
         ((uint64_t)src & T3D_TAG_SRC_MASK);
}

const char *t3d_version_string(void) { return "0.1.0"; }

/* T3D_BUILD_FEATURES: put together by c_src/CMakeLists.txt. */
const char *t3d_build_features(void) { return T3D_BUILD_FEATURES; }

void t3d__block_extent(int n, const size_t *counts, const size_t *displs, size_t es, size_t *lo, size_t *hi) {
  *lo = SIZE_MAX;
  *hi = 0;
  for (int p = 0; p < n; p++) {
    if (counts[p] == 0) continue;
    if (displs[p] * es < *lo) *lo = displs[p] * es;
    if ((displs[p] + counts[p]) * es > *hi) *hi = (displs[p] + counts[p]) * es;
  }
  if (*hi == 0) *lo = 0;
}

int t3d__alltoall_overlaps(int n, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                           const void *recvbuf, const size_t *rcounts, const size_t *rdispls, size_t es) {
  size_t slo, shi, rlo, rhi;
  t3d__block_extent(n, scounts, sdispls, es, &slo, &shi);
  t3d__block_extent(n, rcounts, rdispls, es, &rlo, &rhi);
  return t3d__overlap((const char *)sendbuf + slo, shi - slo, (const char *)recvbuf + rlo, rhi - rlo);
}

t3d_result_t t3d__alltoall_source(int n, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                                  const void *recvbuf, const size_t *rcounts, const size_t *rdispls, size_t es,
                                  const char **src, size_t *bias, void **copy) {
  const char *sb = sendbuf;
  size_t slo, shi;
  *src = sb;
  *bias = 0;
  *copy = NULL;
  if (!t3d__alltoall_overlaps(n, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, es)) return T3D_OK;
  t3d__block_extent(n, scounts, sdispls, es, &slo, &shi);
  char *c = malloc(shi - slo);
  if (c == NULL) return T3D_ERR_NO_MEMORY;
  memcpy(c, sb + slo, shi - slo);
  *src = c;
  *bias = slo;
  *copy = c;
  return T3D_OK;
}

int t3d__grow_scratch(void **buf, size_t *cap, size_t bytes) {
  if (*cap >= bytes) return 1;
  void *p = malloc(bytes);
  if (p == NULL) return 0;
  free(*buf);
  *buf = p;
  *cap = bytes;
  return 1;
}
