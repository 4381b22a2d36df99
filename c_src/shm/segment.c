/* segment.c: the shared-memory segment of a communicator whose ranks share a host: its layout, its life (rank 0
 * creates and sizes it, every rank maps it, rank 0 unlinks it as soon as all have, each unmaps it at fini), the
 * agreement at init on what the group may use (point-to-point over the segment, the single-copy ranges) and the
 * tuning read once then. */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
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

static size_t layout_bytes(int n, size_t half, size_t p2p_eager, unsigned p2p_slots, size_t p2p_stage) {
  return data_end(n, half) + round_up(t3d__shm_p2p_bytes(n, p2p_eager, p2p_slots, p2p_stage), T3D_SHM_PAGE);
}

static void layout(t3d_shm_t *s) {
  s->ctrl = s->base + T3D_SHM_PAGE;
  s->data = s->ctrl + round_up((size_t)s->size * T3D_SHM_CTRL_STRIDE, T3D_SHM_PAGE);
  s->small = s->data + (size_t)s->size * 2 * s->half;
  s->p2p_region = s->base + data_end(s->size, s->half);
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
  size_t stage = 0;
  t3d__shm_p2p_sizes(s->size, &eager, &slots, &stage);
  size_t total = layout_bytes(s->size, half, eager, slots, stage);
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
    char stage_hint[160] = "";
    if (stage > 0)
      snprintf(stage_hint, sizeof stage_hint, ", set T3D_SHM_P2P_STAGE_BYTES=0 (drops %zu bytes of point-to-point "
               "staging areas)", t3d__shm_p2p_bytes(s->size, eager, slots, stage) - t3d__shm_p2p_bytes(s->size, eager,
                                                                                                     slots, 0));
    snprintf(err, errlen,
             "cannot reserve %zu bytes in /dev/shm for the shared-memory segment of group '%s' (%d ranks x %zu bytes; "
             "T3D_SHM_BYTES sets the bytes per rank): %s; free space in /dev/shm (df -h /dev/shm), lower "
             "T3D_SHM_BYTES%s%s",
             total, comm->name, s->size, 2 * half, strerror(rc), stage_hint,
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
  hdr->p2p_stage = stage;
  s->p2p_eager = eager;
  s->p2p_slots = slots;
  s->p2p_stage = stage;
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
      hdr->p2p_slots > 1024 || hdr->p2p_eager > (1u << 20) || hdr->p2p_stage > ((uint64_t)16 << 20) ||
      layout_bytes(s->size, (size_t)hdr->half, (size_t)hdr->p2p_eager, (unsigned)hdr->p2p_slots,
                   (size_t)hdr->p2p_stage) != total) {
    snprintf(err, errlen, "segment %s does not hold a %d-rank t3d layout", s->name, s->size);
    return T3D_ERR_SYSTEM;
  }
  s->half = (size_t)hdr->half;
  s->p2p_eager = (size_t)hdr->p2p_eager;
  s->p2p_slots = (unsigned)hdr->p2p_slots;
  s->p2p_stage = (size_t)hdr->p2p_stage;
  layout(s);
  return T3D_OK;
}

static void read_tuning(t3d_shm_t *s) {
  int64_t v = t3d__param_int(T3D_PARAM_SHM_ONESHOT_BYTES);
  s->oneshot_max = v < 0 ? 0 : (size_t)v;
  if (s->oneshot_max > s->half) s->oneshot_max = s->half;
  v = t3d__param_int(T3D_PARAM_SHM_CHUNK_BYTES);
  s->chunk = v > 0 && (size_t)v < s->half ? (size_t)v : s->half;
  v = t3d__param_int(T3D_PARAM_SHM_NT_BYTES);
  s->nt_min = v <= 0 ? SIZE_MAX : (size_t)v;
  s->nt = t3d__shm_nt_available();
  s->handoff_nt = s->nt && t3d__shm_llc_may_split();
  /* As many ranks as cores: no blind spinning, but a peer seen running on another core is worth a short spin. */
  s->cpu_aware = t3d__cores_filled() && !t3d__oversubscribed();
  v = t3d__param_int(T3D_PARAM_SHM_FAR_NS);
  s->far_ns = v < 0 ? 0 : (uint64_t)v;
  /* Liveness checks need the peers' process ids to mean the same here: true where the ranks could read each
   * other's memory at init (cross-memory attach, which addresses a process by its id), not across pid namespaces. */
  v = t3d__param_int(T3D_PARAM_SHM_LIVENESS_MS);
  int pids_shared = s->p2p_ok || s->direct_max > 0 || s->a2a_direct_max > 0 || s->bcast_direct_max > 0;
  s->liveness_ns = v <= 0 || !pids_shared ? 0 : (uint64_t)v * 1000000u;
  /* For the others' liveness checks (0 until written: not checked). */
  atomic_store_explicit(t3d__shm_pid(s, s->rank), (int32_t)s->pid, memory_order_release);
}

/* "name pid probe", or "!reason" when rank 0 failed. Each other rank answers "mapped/<rank>" with "1 bits pid probe"
 * (bits: t3d__shm_probe_bits of rank 0's probe word, direct.c) or "!reason"; rank 0 unlinks the name once all
 * answered and publishes "ready": "1 p2p min max" (p2p: every rank, rank 0 reading rank 1's word, can run
 * point-to-point over the segment; min, max: the block sizes for which collectives read peers' buffers, 0 0 unless
 * every rank can) or "!reason". So a failure anywhere fails init on every rank, all ranks agree on how
 * point-to-point and the collectives go, and no file outlives init. */
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
  s->m_in = malloc(sizeof(char *) * 2 * (size_t)comm->size);
  s->m_out = s->m_in != NULL ? s->m_in + comm->size : NULL;
  char err[700] = "", key[48];
  void *v = NULL;
  size_t len = 0;
  t3d_result_t res = T3D_OK;
  if (s->pending == NULL || s->srcs == NULL || s->offs == NULL || s->raddr == NULL || s->rpid == NULL ||
      s->m_in == NULL) {
    res = t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d_comm_init: out of memory for shm state");
    goto fail;
  }
  if (comm->rank == 0) {
    int64_t want = t3d__param_int(T3D_PARAM_SHM_BYTES);
    t3d_result_t cres = create_segment(comm, s, want > 0 ? (size_t)want : DEFAULT_RANK_BYTES, err, sizeof err);
    char msg[720];
    if (cres == T3D_OK) {
      snprintf(msg, sizeof msg, "%s %d %llx", s->name, (int)getpid(),
               (unsigned long long)(uintptr_t)&t3d__shm_cma_probe_word);
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
    int all_bits = comm->size > 1 ? T3D_SHM_PROBE_CMA | T3D_SHM_PROBE_P2P
                                  : t3d__shm_probe_bits(s->pid, (uintptr_t)&t3d__shm_cma_probe_word);
    for (int p = 1; p < comm->size && peers == T3D_OK; p++) {
      snprintf(key, sizeof key, "shm/mapped/%d", p);
      peers = t3d__store_get(comm, key, &v, &len);
      int bits = 0, pid = 0;
      unsigned long long addr = 0;
      if (peers == T3D_OK && len > 0 && ((char *)v)[len - 1] == '\0' &&
          sscanf((char *)v, "1 %d %d %llx", &bits, &pid, &addr) == 3) {
        all_bits &= bits & (p != 1 ? T3D_SHM_PROBE_CMA | T3D_SHM_PROBE_P2P : t3d__shm_probe_bits(pid, addr));
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
    s->p2p_ok = (all_bits & T3D_SHM_PROBE_P2P) != 0;
    t3d__shm_direct_ranges(s, comm->size, (all_bits & T3D_SHM_PROBE_CMA) != 0);
    /* Mapping a peer's t3d memory opens /proc/<pid>/fd/<n>: allowed wherever reading its memory is. */
    int64_t mapped = t3d__param_int(T3D_PARAM_SHM_MAPPED_BYTES);
    s->mapped_min = (all_bits & T3D_SHM_PROBE_CMA) != 0 && mapped > 0 ? (size_t)mapped : 0;
    /* Placement probes: two ranks with a core each (t3d__shm_far; with more ranks than cores the scheduler, not
     * the placement, decides where lines come from), on CPUs whose cores may sit on different last-level caches
     * unless T3D_SHM_PLACEMENT_BYTES is set (elsewhere the answer would only cost the probes). */
    int64_t place = t3d__param_int(T3D_PARAM_SHM_PLACEMENT_BYTES);
    int probe = t3d__shm_llc_may_split() || t3d__param_is_set(T3D_PARAM_SHM_PLACEMENT_BYTES);
    s->place_min = comm->size == 2 && !t3d__oversubscribed() && place > 0 && probe ? (size_t)place : 0;
    if (peers == T3D_OK)
      snprintf(msg, sizeof msg, "1 %d %zu %zu %zu %zu %zu %zu %zu %zu", s->p2p_ok, s->direct_min, s->direct_max,
               s->a2a_direct_min, s->a2a_direct_max, s->bcast_direct_min, s->bcast_direct_max, s->mapped_min,
               s->place_min);
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
      snprintf(msg, sizeof msg, "1 %d %d %llx", t3d__shm_probe_bits(pid0, addr0), (int)getpid(),
               (unsigned long long)(uintptr_t)&t3d__shm_cma_probe_word);
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
    unsigned long long dmin = 0, dmax = 0, amin = 0, amax = 0, bmin = 0, bmax = 0, mmin = 0, pmin = 0;
    if (len == 0 || ((char *)v)[len - 1] != '\0' ||
        sscanf((char *)v, "1 %d %llu %llu %llu %llu %llu %llu %llu %llu", &p2p_ok, &dmin, &dmax, &amin, &amax, &bmin,
               &bmax, &mmin, &pmin) != 9) {
      res = t3d__set_error(comm, T3D_ERR_SYSTEM, "t3d_comm_init: rank %d of group '%s': shared memory set-up failed: "
                           "%.*s", comm->rank, comm->name, (int)(len > 1 ? len - 2 : 0), len > 1 ? (char *)v + 1 : "");
      goto fail;
    }
    s->p2p_ok = p2p_ok;
    s->direct_min = (size_t)dmin;
    s->direct_max = (size_t)dmax;
    s->a2a_direct_min = (size_t)amin;
    s->a2a_direct_max = (size_t)amax;
    s->bcast_direct_min = (size_t)bmin;
    s->bcast_direct_max = (size_t)bmax;
    s->mapped_min = (size_t)mmin;
    s->place_min = (size_t)pmin;
    free(v);
    v = NULL;
  }
  read_tuning(s);
  T3D_INFO("group '%s' rank %d: shared memory %s, %zu bytes, halves of %zu bytes, point-to-point %s, single copy "
           "for allgather blocks of %zu to %zu bytes, alltoall blocks of %zu to %zu and broadcasts of %zu to %zu (0: off), "
           "t3d memory in place from %zu bytes (0: never), placement timed from %zu bytes (0: never)", comm->name,
           comm->rank, s->name, s->map_bytes, s->half, s->p2p_ok ? "over shared memory" : "over UCX", s->direct_min,
           s->direct_max, s->a2a_direct_min, s->a2a_direct_max, s->bcast_direct_min, s->bcast_direct_max,
           s->mapped_min, s->place_min);
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
  free(s->m_in);
  free(s);
}

