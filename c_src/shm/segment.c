/* shm.c: the shared-memory segment of a communicator whose ranks share a host (create, publish, map, unlink at once,
 * unmap) and the flag protocol the collectives in coll.c are built from. */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---------- tuning ---------- */

/* Per rank: two halves of 1 MiB. 8 ranks x 6 communicators then hold 96 MiB of /dev/shm. */
#define DEFAULT_RANK_BYTES (2u << 20)

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* ---------- segment ---------- */

static atomic_uint segment_counter;

static uint32_t random_bits(void) {
  uint64_t x = t3d__now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&x;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return (uint32_t)x;
}

static size_t data_end(int n, size_t half) {
  return T3D_SHM_PAGE + round_up((size_t)n * T3D_SHM_CTRL_STRIDE, T3D_SHM_PAGE) + (size_t)n * 2 * half +
         (size_t)n * T3D_SHM_SMALL_SLOTS * T3D_SHM_SMALL_BYTES;
}

static size_t layout_bytes(int n, size_t half, size_t p2p_eager, unsigned p2p_slots) {
  return data_end(n, half) + round_up(t3d__shm_p2p_bytes(n, p2p_eager, p2p_slots), T3D_SHM_PAGE);
}

static void layout(t3d_shm_t *s) {
  s->ctrl = s->base + T3D_SHM_PAGE;
  s->data = s->ctrl + round_up((size_t)s->size * T3D_SHM_CTRL_STRIDE, T3D_SHM_PAGE);
  s->small = s->data + (size_t)s->size * 2 * s->half;
  s->p2p_region = s->base + data_end(s->size, s->half);
}

/* Point-to-point reads a peer's buffer with process_vm_readv (cross-memory attach), which a seccomp filter, the Yama
 * LSM or differing users can forbid. Each rank checks that it can read this word in another rank's process. */
static const uint64_t cma_probe_word = T3D_SHM_MAGIC;

static int cma_works(int pid, unsigned long long addr) {
  if (pid == (int)getpid()) return 1;
  uint64_t got = 0;
  struct iovec local = {&got, sizeof got}, remote = {(void *)(uintptr_t)addr, sizeof got};
  return process_vm_readv(pid, &local, 1, &remote, 1, 0) == (ssize_t)sizeof got && got == T3D_SHM_MAGIC;
}

/* What this rank can do with rank pid's memory: bit 0, read it (cross-memory attach works); bit 1, also run
 * point-to-point over shared memory (T3D_SHM_P2P, default 1). */
#define PROBE_CMA 1
#define PROBE_P2P 2
static int probe_bits(int pid, unsigned long long addr) {
  if (!cma_works(pid, addr)) return 0;
  return PROBE_CMA | (t3d__env_int("T3D_SHM_P2P", 1) != 0 ? PROBE_P2P : 0);
}

int t3d__shm_cma_read(int self_pid, int pid, void *dst, uint64_t addr, size_t len) {
  if (pid == self_pid) { /* ranks of one process (threads): the buffer is in this address space */
    memcpy(dst, (const void *)(uintptr_t)addr, len);
    return 0;
  }
  size_t done = 0;
  while (done < len) {
    struct iovec local = {(char *)dst + done, len - done};
    struct iovec remote = {(void *)(uintptr_t)(addr + done), len - done};
    ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return got < 0 ? errno : EIO;
    done += (size_t)got;
  }
  return 0;
}

/* Rank 0's choice of the single-copy ranges for the group (cma: every rank can read the others' memory).
 * T3D_SHM_DIRECT_BYTES / T3D_SHM_DIRECT_MAX_BYTES, when set, give both ranges. Otherwise: blocks of 16 KiB to
 * 8 MiB when each rank has a core (2 ranks: 32-64 KiB allgather and alltoall 2x faster than through the segment,
 * 4 KiB blocks even). With more ranks than cores, where copies are not what bounds a collective,
 * allgather keeps the segment (8 ranks on 2 cores: up to 1.5x slower with single copy, since each block is read by
 * n - 1 readers from the owner's process instead of from the cached segment). alltoall reads each block once, and
 * single copy halves its bytes: it wins there from 32 KiB blocks for as long as all n * n blocks together stay
 * within 32 MiB, past which the kernel's copy (no non-temporal stores) loses (measured, oversubscribed 2 cores:
 * 8 ranks 1.4-1.5x faster for 32-512 KiB blocks, even at 1 MiB, slower at 2 MiB; 4 ranks faster up to 2 MiB; and
 * 2 ranks with a core each lose past 8 MiB: the same 32 MiB). docs/architecture.md, "Single copy". */
static void direct_ranges(t3d_shm_t *s, int n, int cma) {
  int64_t lo = t3d__env_int("T3D_SHM_DIRECT_BYTES", T3D_SHM_DIRECT_MIN_DEFAULT);
  int64_t hi = t3d__env_int("T3D_SHM_DIRECT_MAX_BYTES", T3D_SHM_DIRECT_MAX_DEFAULT);
  int asked = t3d__env_str("T3D_SHM_DIRECT_BYTES", NULL) != NULL;
  int over = t3d__oversubscribed();
  int direct = cma && (asked || !over) && lo > 0 && hi >= lo;
  s->direct_min = direct ? (size_t)lo : 0;
  s->direct_max = direct ? (size_t)hi : 0;
  s->a2a_direct_min = s->direct_min;
  s->a2a_direct_max = s->direct_max;
  if (cma && over && !asked && n > 1) {
    size_t amax = T3D_SHM_A2A_DIRECT_TOTAL / ((size_t)n * (size_t)n);
    int on = amax >= T3D_SHM_A2A_DIRECT_MIN_OVERSUBSCRIBED;
    s->a2a_direct_min = on ? T3D_SHM_A2A_DIRECT_MIN_OVERSUBSCRIBED : 0;
    s->a2a_direct_max = on ? amax : 0;
  }
}

/* Rank 0: creates, sizes and maps the segment. On failure writes the reason into err. */
static t3d_result_t create_segment(t3d_comm_t *comm, t3d_shm_t *s, size_t rank_bytes, char *err, size_t errlen) {
  size_t half = round_up(rank_bytes / 2, T3D_SHM_PAGE);
  /* Every rank's alltoall / reduce_scatter piece is at least one cache line. */
  size_t min_half = round_up((size_t)s->size * 64 * 4, T3D_SHM_PAGE);
  if (half < min_half) half = min_half;
  if (half < 64 * 1024) half = 64 * 1024;
  size_t eager = 0;
  unsigned slots = 0;
  t3d__shm_p2p_sizes(s->size, &eager, &slots);
  size_t total = layout_bytes(s->size, half, eager, slots);
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; attempt++) {
    snprintf(s->name, sizeof s->name, "/t3d-%d-%u-%08x", (int)getpid(), atomic_fetch_add(&segment_counter, 1),
             random_bits());
    fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    snprintf(err, errlen, "shm_open(%s) failed: %s", s->name, strerror(errno));
    return T3D_ERR_SYSTEM;
  }
  t3d_result_t res = T3D_OK;
  /* ftruncate alone gives a sparse file: on a full /dev/shm the first touch of a page would raise SIGBUS in the
   * middle of a collective. posix_fallocate reserves every page now, so the failure is here, with a reason. */
  int rc = ftruncate(fd, (off_t)total) == 0 ? 0 : errno;
  if (rc == 0) rc = posix_fallocate(fd, 0, (off_t)total);
  if (rc != 0) {
    snprintf(err, errlen,
             "cannot reserve %zu bytes in /dev/shm for the shared-memory segment of group '%s' (%d ranks x %zu bytes; "
             "T3D_SHM_BYTES sets the bytes per rank): %s; free space in /dev/shm (df -h /dev/shm), lower "
             "T3D_SHM_BYTES%s",
             total, comm->name, s->size, 2 * half, strerror(rc),
             T3D_HAVE_UCX ? ", or set T3D_TRANSPORT=ucx" : "");
    res = (rc == ENOSPC || rc == ENOMEM || rc == EFBIG) ? T3D_ERR_NO_MEMORY : T3D_ERR_SYSTEM;
    goto fail;
  }
  s->base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (s->base == MAP_FAILED) {
    s->base = NULL;
    snprintf(err, errlen, "mmap of %zu bytes of %s failed: %s", total, s->name, strerror(errno));
    res = T3D_ERR_NO_MEMORY;
    goto fail;
  }
  close(fd);
  s->map_bytes = total;
  s->half = half;
  t3d_shm_header_t *hdr = (t3d_shm_header_t *)(void *)s->base;
  hdr->nranks = (uint64_t)s->size;
  hdr->half = half;
  hdr->total = total;
  hdr->p2p_eager = eager;
  hdr->p2p_slots = slots;
  s->p2p_eager = eager;
  s->p2p_slots = slots;
  hdr->magic = T3D_SHM_MAGIC; /* published to the others through the store, which orders it */
  layout(s);
  return T3D_OK;
fail:
  close(fd);
  shm_unlink(s->name);
  return res;
}

/* The other ranks: open and map what rank 0 published. */
static t3d_result_t attach_segment(t3d_shm_t *s, char *err, size_t errlen) {
  int fd = shm_open(s->name, O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    snprintf(err, errlen, "shm_open(%s) failed: %s (is this rank really on rank 0's host, in its IPC namespace?)",
             s->name, strerror(errno));
    return T3D_ERR_SYSTEM;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < (off_t)T3D_SHM_PAGE) {
    snprintf(err, errlen, "segment %s has an unexpected size", s->name);
    close(fd);
    return T3D_ERR_SYSTEM;
  }
  size_t total = (size_t)st.st_size;
  s->base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (s->base == MAP_FAILED) {
    s->base = NULL;
    snprintf(err, errlen, "mmap of %zu bytes of %s failed: %s", total, s->name, strerror(errno));
    return T3D_ERR_NO_MEMORY;
  }
  s->map_bytes = total;
  const t3d_shm_header_t *hdr = (const t3d_shm_header_t *)(const void *)s->base;
  if (hdr->magic != T3D_SHM_MAGIC || hdr->nranks != (uint64_t)s->size || hdr->total != total ||
      hdr->p2p_slots > 1024 || hdr->p2p_eager > (1u << 20) ||
      layout_bytes(s->size, (size_t)hdr->half, (size_t)hdr->p2p_eager, (unsigned)hdr->p2p_slots) != total) {
    snprintf(err, errlen, "segment %s does not hold a %d-rank t3d layout", s->name, s->size);
    return T3D_ERR_SYSTEM;
  }
  s->half = (size_t)hdr->half;
  s->p2p_eager = (size_t)hdr->p2p_eager;
  s->p2p_slots = (unsigned)hdr->p2p_slots;
  layout(s);
  return T3D_OK;
}

static void read_tuning(t3d_shm_t *s) {
  int64_t v = t3d__env_int("T3D_SHM_ONESHOT_BYTES", 64 * 1024);
  s->oneshot_max = v < 0 ? 0 : (size_t)v;
  if (s->oneshot_max > s->half) s->oneshot_max = s->half;
  v = t3d__env_int("T3D_SHM_CHUNK_BYTES", 0);
  s->chunk = v > 0 && (size_t)v < s->half ? (size_t)v : s->half;
  v = t3d__env_int("T3D_SHM_NT_BYTES", 4 << 20);
  s->nt_min = v <= 0 ? SIZE_MAX : (size_t)v;
  s->nt = t3d__shm_nt_available();
  /* As many ranks as cores: no blind spinning, but a peer seen running on another core is worth a short spin. */
  s->cpu_aware = t3d__cores_filled() && !t3d__oversubscribed();
}

/* "name pid probe", or "!reason" when rank 0 failed. Each other rank answers "mapped/<rank>" with "1 bits pid probe"
 * (bits: probe_bits of rank 0's probe word) or "!reason"; rank 0 unlinks the name once all answered and publishes
 * "ready": "1 p2p min max" (p2p: every rank, rank 0 reading rank 1's word, can run point-to-point over the
 * segment; min, max: the block sizes for which collectives read peers' buffers, 0 0 unless every rank can) or
 * "!reason". So a
 * failure anywhere fails init on every rank, all ranks agree on how point-to-point and the collectives go, and no
 * file outlives init. */
t3d_result_t t3d__shm_init(t3d_comm_t *comm, t3d_shm_t **out) {
  *out = NULL;
  t3d_shm_t *s = calloc(1, sizeof *s);
  if (s == NULL) return t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d_comm_init: out of memory for shm state");
  s->rank = comm->rank;
  s->size = comm->size;
  s->pid = (int)getpid();
  s->pending = malloc(sizeof(int) * (size_t)comm->size);
  s->srcs = malloc(sizeof(void *) * (size_t)comm->size);
  s->offs = malloc(sizeof(size_t) * (size_t)comm->size);
  s->raddr = malloc(sizeof(uint64_t) * (size_t)comm->size);
  s->rpid = malloc(sizeof(int) * (size_t)comm->size);
  char err[700] = "", key[48];
  void *v = NULL;
  size_t len = 0;
  t3d_result_t res = T3D_OK;
  if (s->pending == NULL || s->srcs == NULL || s->offs == NULL || s->raddr == NULL || s->rpid == NULL) {
    res = t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d_comm_init: out of memory for shm state");
    goto fail;
  }
  if (comm->rank == 0) {
    int64_t want = t3d__env_int("T3D_SHM_BYTES", DEFAULT_RANK_BYTES);
    t3d_result_t cres = create_segment(comm, s, want > 0 ? (size_t)want : DEFAULT_RANK_BYTES, err, sizeof err);
    char msg[720];
    if (cres == T3D_OK) {
      snprintf(msg, sizeof msg, "%s %d %llx", s->name, (int)getpid(),
               (unsigned long long)(uintptr_t)&cma_probe_word);
    }
    else snprintf(msg, sizeof msg, "!%s", err);
    res = t3d__store_set(comm, "shm/name", msg, strlen(msg) + 1);
    if (cres != T3D_OK) {
      res = t3d__set_error(comm, cres, "t3d_comm_init: rank 0 of group '%s': %s", comm->name, err);
      goto fail;
    }
    if (res != T3D_OK) {
      shm_unlink(s->name);
      goto fail;
    }
    t3d_result_t peers = T3D_OK;
    /* A group of one gets a segment only without UCX (comm.c), and then needs its point-to-point. */
    int all_bits = comm->size > 1 ? PROBE_CMA | PROBE_P2P : probe_bits(s->pid, (uintptr_t)&cma_probe_word);
    for (int p = 1; p < comm->size && peers == T3D_OK; p++) {
      snprintf(key, sizeof key, "shm/mapped/%d", p);
      peers = t3d__store_get(comm, key, &v, &len);
      int bits = 0, pid = 0;
      unsigned long long addr = 0;
      if (peers == T3D_OK && len > 0 && ((char *)v)[len - 1] == '\0' &&
          sscanf((char *)v, "1 %d %d %llx", &bits, &pid, &addr) == 3) {
        all_bits &= bits & (p != 1 ? PROBE_CMA | PROBE_P2P : probe_bits(pid, addr));
      } else if (peers == T3D_OK && (len == 0 || ((char *)v)[0] == '!')) {
        snprintf(err, sizeof err, "rank %d could not map the segment: %.*s", p, (int)(len > 1 ? len - 2 : 0),
                 len > 1 ? (char *)v + 1 : "");
        peers = T3D_ERR_SYSTEM;
      } else if (peers != T3D_OK) {
        snprintf(err, sizeof err, "rank %d did not say it mapped the segment (%s)", p, t3d_result_string(peers));
      } else {
        all_bits = 0;
      }
      free(v);
      v = NULL;
    }
    shm_unlink(s->name);
    s->p2p_ok = (all_bits & PROBE_P2P) != 0;
    direct_ranges(s, comm->size, (all_bits & PROBE_CMA) != 0);
    if (peers == T3D_OK)
      snprintf(msg, sizeof msg, "1 %d %zu %zu %zu %zu", s->p2p_ok, s->direct_min, s->direct_max, s->a2a_direct_min,
               s->a2a_direct_max);
    else snprintf(msg, sizeof msg, "!%s", err);
    res = t3d__store_set(comm, "shm/ready", msg, strlen(msg) + 1);
    if (peers != T3D_OK) {
      res = t3d__set_error(comm, peers, "t3d_comm_init: shared memory of group '%s': %s", comm->name, err);
      goto fail;
    }
    if (res != T3D_OK) goto fail;
  } else {
    T3D_CHECK_GOTO(t3d__store_get(comm, "shm/name", &v, &len), res, fail);
    int pid0 = 0;
    unsigned long long addr0 = 0;
    if (len == 0 || ((char *)v)[0] == '!' || ((char *)v)[len - 1] != '\0' ||
        sscanf((char *)v, "%63s %d %llx", s->name, &pid0, &addr0) != 3) {
      res = t3d__set_error(comm, T3D_ERR_SYSTEM, "t3d_comm_init: rank %d of group '%s': rank 0 could not set up "
                           "shared memory: %.*s", comm->rank, comm->name, (int)(len > 1 ? len - 2 : 0),
                           len > 1 ? (char *)v + 1 : "");
      goto fail;
    }
    free(v);
    v = NULL;
    t3d_result_t ares = attach_segment(s, err, sizeof err);
    char msg[720];
    if (ares == T3D_OK) {
      snprintf(msg, sizeof msg, "1 %d %d %llx", probe_bits(pid0, addr0), (int)getpid(),
               (unsigned long long)(uintptr_t)&cma_probe_word);
    } else {
      snprintf(msg, sizeof msg, "!%s", err);
    }
    snprintf(key, sizeof key, "shm/mapped/%d", comm->rank);
    res = t3d__store_set(comm, key, msg, strlen(msg) + 1);
    if (ares != T3D_OK) {
      res = t3d__set_error(comm, ares, "t3d_comm_init: rank %d of group '%s': %s", comm->rank, comm->name, err);
      goto fail;
    }
    if (res != T3D_OK) goto fail;
    T3D_CHECK_GOTO(t3d__store_get(comm, "shm/ready", &v, &len), res, fail);
    int p2p_ok = 0;
    unsigned long long dmin = 0, dmax = 0, amin = 0, amax = 0;
    if (len == 0 || ((char *)v)[len - 1] != '\0' ||
        sscanf((char *)v, "1 %d %llu %llu %llu %llu", &p2p_ok, &dmin, &dmax, &amin, &amax) != 5) {
      res = t3d__set_error(comm, T3D_ERR_SYSTEM, "t3d_comm_init: rank %d of group '%s': shared memory set-up failed: "
                           "%.*s", comm->rank, comm->name, (int)(len > 1 ? len - 2 : 0), len > 1 ? (char *)v + 1 : "");
      goto fail;
    }
    s->p2p_ok = p2p_ok;
    s->direct_min = (size_t)dmin;
    s->direct_max = (size_t)dmax;
    s->a2a_direct_min = (size_t)amin;
    s->a2a_direct_max = (size_t)amax;
    free(v);
    v = NULL;
  }
  read_tuning(s);
  T3D_INFO("group '%s' rank %d: shared memory %s, %zu bytes, halves of %zu bytes, point-to-point %s, single copy "
           "for allgather blocks of %zu to %zu bytes and alltoall blocks of %zu to %zu (0: off)", comm->name,
           comm->rank, s->name, s->map_bytes, s->half, s->p2p_ok ? "over shared memory" : "over UCX", s->direct_min,
           s->direct_max, s->a2a_direct_min, s->a2a_direct_max);
  *out = s;
  return T3D_OK;
fail:
  free(v);
  t3d__shm_fini(s);
  return res;
}

void t3d__shm_fini(t3d_shm_t *s) {
  if (s == NULL) return;
  if (s->base != NULL) munmap(s->base, s->map_bytes);
  free(s->pending);
  free(s->srcs);
  free(s->offs);
  free(s->raddr);
  free(s->rpid);
  free(s);
}

/* ---------- protocol ---------- */

/* A step in region h (a half or a small slot), whose last use ends at *free_at. */
static void step_begin(t3d_shm_t *s, int nphases, int h, uint64_t *free_at, t3d_shm_step_t *st) {
  st->h = h;
  st->base = s->phase;
  st->first = 0;
  st->need = *free_at;
  s->phase += (uint64_t)nphases;
  *free_at = s->phase;
}

void t3d__shm_step_begin(t3d_shm_t *s, int nphases, t3d_shm_step_t *st) {
  t3d__shm_settle(s);
  int h = (int)(s->step++ & 1);
  step_begin(s, nphases, h, &s->free_at[h], st);
}

void t3d__shm_step_begin_small(t3d_shm_t *s, int nphases, t3d_shm_step_t *st) {
  t3d__shm_settle(s);
  int j = (int)(s->small_steps++ % T3D_SHM_SMALL_SLOTS);
  step_begin(s, nphases, 2 + j, &s->free_small[j], st);
}

int t3d__shm_all_past(t3d_shm_t *s, uint64_t need) {
  if (s->seen_all >= need) return 1;
  for (int p = 0; p < s->size; p++) {
    if (p != s->rank && atomic_load_explicit(t3d__shm_flag(s, p), memory_order_acquire) < need) return 0;
  }
  s->seen_all = need;
  return 1;
}

t3d_result_t t3d__shm_step_acquire(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st) {
  if (s->seen_all >= st->need) return T3D_OK;
  return t3d__shm_wait(s, ex, -1, st->need);
}

/* ---------- blocking on a peer's flag ----------
 * The futex word is the low half of the 64-bit flag (x86-64 is little-endian). Shared, not private: the segment is
 * mapped by several processes. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the futex word is the flag's low half");

void t3d__shm_wake(t3d_shm_t *s) {
  syscall(SYS_futex, (void *)t3d__shm_flag(s, s->rank), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void t3d__shm_sleep(t3d_shm_t *s, int p, uint64_t target, uint64_t max_ns) {
  _Atomic uint32_t *sleepers = t3d__shm_sleepers(s, p);
  t3d__shm_settle(s);
  if (s->cpu_aware) atomic_store_explicit(t3d__shm_cpu(s, s->rank), 0u, memory_order_relaxed);
  atomic_fetch_add_explicit(sleepers, 1, memory_order_seq_cst);
  uint64_t v = atomic_load_explicit(t3d__shm_flag(s, p), memory_order_seq_cst);
  if (v < target) {
    struct timespec ts = {(time_t)(max_ns / 1000000000u), (long)(max_ns % 1000000000u)};
    /* Returns at once if the word changed meanwhile (EAGAIN); a wake or the timeout end it otherwise. */
    syscall(SYS_futex, (void *)t3d__shm_flag(s, p), FUTEX_WAIT, (uint32_t)v, &ts, NULL, 0);
  }
  atomic_fetch_sub_explicit(sleepers, 1, memory_order_relaxed);
  t3d__shm_note_cpu(s);
}

void t3d__shm_backoff(t3d_shm_t *s, t3d_backoff_t *b, int p, uint64_t target, uint64_t until) {
  int running = 0;
  if (s->cpu_aware) {
    if (b->since == 0) t3d__shm_note_cpu(s); /* starting to wait: this rank runs here now */
    uint32_t cpu = atomic_load_explicit(t3d__shm_cpu(s, p), memory_order_relaxed);
    running = cpu != 0 && cpu != (uint32_t)sched_getcpu() + 1u;
  }
  /* A rank waiting here may hold up point-to-point that only this process can move: its own sends queued behind a
   * full ring, and the slots of peers' rings that only its scan frees. */
  if (s->p2p != NULL && t3d__shm_p2p_progress(s->p2p) > 0) t3d__backoff_reset(b);
  if (!(running ? t3d__backoff_poll_running(b) : t3d__backoff_poll(b))) return;
  uint64_t max_ns = 1000000;
  if (until != 0) {
    uint64_t now = t3d__now_ns();
    if (now >= until) return;
    if (until - now < max_ns) max_ns = until - now;
  }
  t3d__shm_sleep(s, p, target, max_ns);
}

/* "rank(s) 1, 3" for the ranks among [lo, hi) below target. */
static void describe_missing(t3d_shm_t *s, int lo, int hi, uint64_t target, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "rank(s) ");
  int listed = 0;
  for (int p = lo; p < hi && used + 24 < len; p++) {
    if (p == s->rank) continue;
    if (atomic_load_explicit(t3d__shm_flag(s, p), memory_order_acquire) >= target) continue;
    used += (size_t)snprintf(buf + used, len - used, "%s%d", listed++ ? ", " : "", p);
  }
  if (used + 24 >= len) snprintf(buf + used, len - used, ", ...");
  snprintf(buf + strlen(buf), len - strlen(buf), " (shared memory)");
}

static t3d_result_t fail_wait(t3d_shm_t *s, t3d_exec_t *ex, int lo, int hi, uint64_t target) {
  char names[256];
  describe_missing(s, lo, hi, target, names, sizeof names);
  return t3d__exec_check(ex, names);
}

/* Whether rank p has reached target: its info line's seq equals a->word, or its flag. With a line to watch, the
 * flag is read only when `flag_too` (its fallback: a peer that posts without setting seq, e.g. one that runs another
 * operation): every read of the flag's line is one more line the peer must take back when it next posts. */
static int arrived(t3d_shm_t *s, int p, uint64_t target, const t3d_shm_arrival_t *a, int flag_too) {
  if (a != NULL) {
    if (atomic_load_explicit(&t3d__shm_info(s, p, a->h)->seq, memory_order_acquire) == a->word) return 1;
    if (!flag_too) return 0;
  }
  return atomic_load_explicit(t3d__shm_flag(s, p), memory_order_acquire) >= target;
}

t3d_result_t t3d__shm_wait_until(t3d_shm_t *s, t3d_exec_t *ex, int who, uint64_t target, uint64_t until) {
  return t3d__shm_wait_line(s, ex, who, target, until, NULL);
}

t3d_result_t t3d__shm_wait_line(t3d_shm_t *s, t3d_exec_t *ex, int who, uint64_t target, uint64_t until,
                                const t3d_shm_arrival_t *a) {
  int lo = who < 0 ? 0 : who, hi = who < 0 ? s->size : who + 1;
  int next = lo; /* flags only grow: a rank seen at target stays there */
  t3d_backoff_t b = {0};
  for (unsigned it = 1;; it++) {
    int before = next;
    while (next < hi && (next == s->rank || arrived(s, next, target, a, (it & 15) == 0))) next++;
    if (next == hi) break;
    if (next != before) t3d__backoff_reset(&b);
    if ((it & 15) == 0 && t3d__exec_check(ex, "") != T3D_OK) return fail_wait(s, ex, lo, hi, target);
    /* Every 8th round: a clock read costs a fair share of a sub-microsecond collective. */
    if (until != 0 && (it & 7) == 0 && t3d__now_ns() >= until) return T3D_IN_PROGRESS;
    t3d__shm_backoff(s, &b, next, target, until);
    /* In the spin phase, watch the awaited rank in a tight loop before the next round: a round (clock read, CPU
     * check, point-to-point pass, 8 pauses) takes ~150 ns, which a sub-microsecond collective would wait out. */
    for (int k = 0; b.spun && k < 32 && !arrived(s, next, target, a, 0); k++) __builtin_ia32_pause();
  }
  if (who < 0 && target > s->seen_all) s->seen_all = target;
  return T3D_OK;
}

t3d_result_t t3d__shm_wait_each(t3d_shm_t *s, t3d_exec_t *ex, uint64_t target, t3d_shm_peer_fn fn, void *arg) {
  int n = s->size, cnt = 0;
  for (int i = 1; i < n; i++) s->pending[cnt++] = (s->rank + i) % n;
  t3d_backoff_t b = {0};
  for (unsigned it = 1; cnt > 0; it++) {
    int progressed = 0;
    for (int i = 0; i < cnt;) {
      int p = s->pending[i];
      if (atomic_load_explicit(t3d__shm_flag(s, p), memory_order_acquire) >= target) {
        fn(arg, p);
        /* Keep the order (nearest rank first) for the ones left. */
        memmove(s->pending + i, s->pending + i + 1, sizeof(int) * (size_t)(cnt - i - 1));
        cnt--;
        progressed = 1;
      } else {
        i++;
      }
    }
    if (cnt == 0) break;
    if (progressed) {
      t3d__backoff_reset(&b);
      continue;
    }
    if ((it & 15) == 0 && t3d__exec_check(ex, "") != T3D_OK) return fail_wait(s, ex, 0, n, target);
    t3d__shm_backoff(s, &b, s->pending[0], target, 0);
  }
  if (target > s->seen_all) s->seen_all = target;
  return T3D_OK;
}

void t3d__shm_put_info(t3d_shm_t *s, const t3d_shm_step_t *st, int kind, uint64_t sig, uint64_t aux) {
  t3d_shm_info_t *in = t3d__shm_info(s, s->rank, st->h);
  in->kind = (uint64_t)kind;
  in->sig = sig;
  in->aux = aux;
  in->addr = 0;
  in->pid = s->pid;
}

static const char *kind_name(uint64_t k) {
  switch (k) {
    case T3D_OP_ALLREDUCE: return "allreduce";
    case T3D_OP_BROADCAST: return "broadcast";
    case T3D_OP_REDUCE: return "reduce";
    case T3D_OP_ALLGATHERV: return "allgather";
    case T3D_OP_REDUCE_SCATTERV: return "reduce_scatter";
    case T3D_OP_ALLTOALLV: return "alltoall";
    default: return "another operation";
  }
}

t3d_result_t t3d__shm_check_info(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, int peer, int kind,
                                 uint64_t sig) {
  const t3d_shm_info_t *in = t3d__shm_info(s, peer, st->h);
  if (in->kind == (uint64_t)kind && in->sig == sig) return T3D_OK;
  snprintf(ex->error, sizeof ex->error,
           "t3d: %s #%llu on group '%s' (rank %d of %d): rank %d runs %s of %llu bytes where this rank runs %s of "
           "%llu bytes (ranks disagree on the operation or its size)",
           ex->opname, (unsigned long long)ex->seq, ex->comm->name, ex->rank, ex->size, peer, kind_name(in->kind),
           (unsigned long long)in->sig, kind_name((uint64_t)kind), (unsigned long long)sig);
  return T3D_ERR_MISMATCH;
}
