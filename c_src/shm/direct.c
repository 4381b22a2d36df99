/* direct.c: single copy, reading another rank's memory straight from its process (cross-memory attach,
 * process_vm_readv): the read itself, which point-to-point's rendezvous (p2p.c) and the collectives' large blocks
 * use; the probe at init that tells whether the ranks may read each other's memory; rank 0's choice of the block
 * sizes for which the collectives do; and the collectives' helpers (which blocks, reading a peer's block). The end
 * of a single-copy step waits on the flags and is t3d__shm_direct_end in shm.h: here it would close a circle of
 * calls (p2p.c reads through this file, and the waits of sync.c run point-to-point). */
#include "shm.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---------- cross-memory attach ---------- */

/* Whether process pid is gone: no such process, or a zombie (exited, not yet reaped by its parent). The liveness
 * checks of the collectives' waits (sync.c) and of point-to-point (p2p.c) use it. */
int t3d__shm_process_gone(int32_t pid) {
  if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
  char path[48], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *end = strrchr(buf, ')'); /* "pid (comm) S ...": the name may hold spaces and parentheses */
  return end != NULL && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}


/* Point-to-point reads a peer's buffer with process_vm_readv (cross-memory attach), which a seccomp filter, the Yama
 * LSM or differing users can forbid. Each rank checks that it can read this word in another rank's process. */
const uint64_t t3d__shm_cma_probe_word = T3D_SHM_MAGIC;

static int cma_works(int pid, unsigned long long addr) {
  if (pid == (int)getpid()) return 1;
  uint64_t got = 0;
  struct iovec local = {&got, sizeof got}, remote = {(void *)(uintptr_t)addr, sizeof got};
  return process_vm_readv(pid, &local, 1, &remote, 1, 0) == (ssize_t)sizeof got && got == T3D_SHM_MAGIC;
}

/* What this rank can do with rank pid's memory: bit 0, read it (cross-memory attach works); bit 1, also run
 * point-to-point over shared memory (T3D_SHM_P2P, default 1). */
int t3d__shm_probe_bits(int pid, unsigned long long addr) {
  if (!cma_works(pid, addr)) return 0;
  return T3D_SHM_PROBE_CMA | (t3d__param_int(T3D_PARAM_SHM_P2P) != 0 ? T3D_SHM_PROBE_P2P : 0);
}

/* One cross-memory-attach transfer of len bytes between here (local) and addr in process pid: process_vm_writev
 * when `write`, else process_vm_readv. */
static int cma_move(int self_pid, int pid, void *local, uint64_t addr, size_t len, int write) {
  if (pid == self_pid) { /* ranks of one process (threads): the buffer is in this address space */
    if (write) memcpy((void *)(uintptr_t)addr, local, len);
    else memcpy(local, (const void *)(uintptr_t)addr, len);
    return 0;
  }
  size_t done = 0;
  while (done < len) {
    struct iovec here = {(char *)local + done, len - done};
    struct iovec there = {(void *)(uintptr_t)(addr + done), len - done};
    ssize_t got = write ? process_vm_writev(pid, &here, 1, &there, 1, 0) : process_vm_readv(pid, &here, 1, &there, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return got < 0 ? errno : EIO;
    done += (size_t)got;
  }
  return 0;
}

int t3d__shm_cma_read(int self_pid, int pid, void *dst, uint64_t addr, size_t len) {
  return cma_move(self_pid, pid, dst, addr, len, 0);
}

/* ---------- single copy ----------
 * Blocks of allgatherv (alltoallv) of direct_min to direct_max (a2a_direct_min to a2a_direct_max) bytes skip the
 * segment: their owner publishes where the block is (allgatherv: the addr and pid of its info line; alltoallv: a
 * table in its step-0 half), readers copy it straight from there (process_vm_readv: one copy instead of two, into
 * the half and out of it), and the owner returns only once every reader says it is done, because its buffer may
 * change after that. All ranks choose alike: rank 0 set the ranges for everyone at init (t3d__shm_direct_ranges
 * below: none unless every rank can read the others' memory; with more ranks than cores, alltoall's only), and the
 * sizes compared with them are the same on every rank (allgatherv) or learned from every rank's step 0
 * (alltoallv). docs/architecture.md, "Single copy", has the measurements behind the ranges. The end of such a step
 * is t3d__shm_direct_end (shm.h). */

/* Rank 0's choice of the single-copy ranges for the group (cma: every rank can read the others' memory).
 * T3D_SHM_DIRECT_BYTES / T3D_SHM_DIRECT_MAX_BYTES, when set, give both ranges. Otherwise: blocks of 16 KiB to
 * 4 MiB when each rank has a core (2 ranks on an Intel CPU: 32-64 KiB allgather and alltoall 2x faster than
 * through the segment, 4 KiB blocks even; 8 MiB blocks 1.2-1.8x slower than the segment's two copies, the kernel's
 * copy moving 5-7 GB/s: docs/benchmarks/allgather-place-2ranks.txt). On AMD's CPUs allgather blocks of 1.5-2 MiB
 * and alltoall blocks of 1-2 MiB: there the segment measured 1.5-3x faster for 16 KiB-1 MiB allgather blocks and
 * 16-512 KiB alltoall blocks, single copy 1.2x faster for 2 MiB allgather and 1 MiB alltoall blocks (1.5 MiB lies
 * between, unmeasured), and the segment 1.1x faster from 4 MiB (docs/benchmarks/direct-max-amd-2ranks.txt,
 * direct-min-amd-2ranks.txt). With more ranks than cores, where copies are
 * not what bounds a collective, allgather keeps the segment (8 ranks on 2 cores: up to 1.5x slower with single
 * copy, since each block is read by n - 1 readers from the owner's process instead of from the cached segment).
 * alltoall reads each block once, and single copy halves its bytes: it wins there from 32 KiB blocks for as long as
 * all n * n blocks together stay within 32 MiB, past which the kernel's copy (no non-temporal stores) loses
 * (measured, oversubscribed 2 cores: 8 ranks 1.4-1.5x faster for 32-512 KiB blocks, even at 1 MiB, slower at
 * 2 MiB; 4 ranks faster up to 2 MiB). Broadcasts (T3D_SHM_BCAST_DIRECT_BYTES) only with a core per rank: 32 KiB
 * to 16 MiB on Intel's CPUs, 64 KiB to 2 MiB on others, where the kernel's slower copy loses from a few MiB
 * (docs/benchmarks/broadcast-split-amd-2ranks.txt). docs/architecture.md, "Single copy". */
void t3d__shm_direct_ranges(t3d_shm_t *s, int n, int cma) {
  int64_t lo = t3d__param_int(T3D_PARAM_SHM_DIRECT_BYTES);
  int64_t hi = t3d__param_int(T3D_PARAM_SHM_DIRECT_MAX_BYTES);
  int asked = t3d__param_is_set(T3D_PARAM_SHM_DIRECT_BYTES);
  int over = t3d__oversubscribed();
  /* AMD: the kernel's copy runs at about 0.3x of a user-space one; the segment's two copies, from lines still in
   * the caches, win outside blocks of about 1-2 MiB */
  int split = !asked && !t3d__param_is_set(T3D_PARAM_SHM_DIRECT_MAX_BYTES) && t3d__shm_llc_may_split();
  if (split) hi = T3D_SHM_DIRECT_MAX_SPLIT;
  int direct = cma && (asked || !over) && lo > 0 && hi >= lo;
  s->direct_min = direct ? (size_t)(split ? T3D_SHM_AG_DIRECT_MIN_SPLIT : lo) : 0;
  s->direct_max = direct ? (size_t)hi : 0;
  s->a2a_direct_min = direct ? (size_t)(split ? T3D_SHM_A2A_DIRECT_MIN_SPLIT : lo) : 0;
  s->a2a_direct_max = s->direct_max;
  if (cma && over && !asked && n > 1) {
    size_t amax = T3D_SHM_A2A_DIRECT_TOTAL / ((size_t)n * (size_t)n);
    int on = amax >= T3D_SHM_A2A_DIRECT_MIN_OVERSUBSCRIBED;
    s->a2a_direct_min = on ? T3D_SHM_A2A_DIRECT_MIN_OVERSUBSCRIBED : 0;
    s->a2a_direct_max = on ? amax : 0;
  }
  lo = t3d__param_int(T3D_PARAM_SHM_BCAST_DIRECT_BYTES);
  hi = t3d__param_int(T3D_PARAM_SHM_BCAST_DIRECT_MAX_BYTES);
  asked = t3d__param_is_set(T3D_PARAM_SHM_BCAST_DIRECT_BYTES);
  if (!asked && t3d__shm_llc_may_split()) { /* AMD: the segment's copies win again from a few MiB */
    lo = T3D_SHM_BCAST_DIRECT_MIN_SPLIT;
    if (!t3d__param_is_set(T3D_PARAM_SHM_BCAST_DIRECT_MAX_BYTES)) hi = T3D_SHM_BCAST_DIRECT_MAX_SPLIT;
  }
  int bcast = cma && lo > 0 && hi >= lo && (asked || !over);
  s->bcast_direct_min = bcast ? (size_t)lo : 0;
  s->bcast_direct_max = bcast ? (size_t)hi : 0;
}

/* Whether x lies in a range rank 0 chose (min 0: the range is off). */
static int in_range(size_t min, size_t max, size_t x) { return min != 0 && x >= min && x <= max; }

int t3d__shm_use_direct(const t3d_shm_t *s, size_t block) { return in_range(s->direct_min, s->direct_max, block); }

int t3d__shm_use_bcast_direct(const t3d_shm_t *s, size_t bytes) {
  return in_range(s->bcast_direct_min, s->bcast_direct_max, bytes);
}

int t3d__shm_use_a2a_direct(const t3d_shm_t *s, size_t block) {
  return in_range(s->a2a_direct_min, s->a2a_direct_max, block);
}

/* A transfer with rank p's memory (read_peer's or write_peer's), failing with ex->error set. */
static t3d_result_t peer_move(t3d_shm_t *s, t3d_exec_t *ex, int p, int pid, void *local, uint64_t addr, size_t len,
                              int write) {
  int err = len > 0 ? cma_move(s->pid, pid, local, addr, len, write) : 0;
  if (err == 0) return T3D_OK;
  if (err == ESRCH) { /* the owner's process is gone */
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d): rank %d's process (pid %d) "
             "is gone", ex->opname, (unsigned long long)ex->seq, ex->comm->name, ex->rank, ex->size, p, pid);
    return T3D_ERR_PEER_LOST;
  }
  snprintf(ex->error, sizeof ex->error,
           "t3d: %s #%llu on group '%s' (rank %d of %d): %s %zu bytes %s rank %d's memory (%s) failed: %s; "
           "T3D_SHM_DIRECT_BYTES=0 and T3D_SHM_BCAST_DIRECT_BYTES=0 copy through shared memory instead",
           ex->opname, (unsigned long long)ex->seq, ex->comm->name, ex->rank, ex->size, write ? "writing" : "reading",
           len, write ? "into" : "from", p, write ? "process_vm_writev" : "process_vm_readv", strerror(err));
  return T3D_ERR_SYSTEM;
}

/* Copies len bytes at addr in rank p's process (pid) into dst. */
t3d_result_t t3d__shm_read_peer(t3d_shm_t *s, t3d_exec_t *ex, int p, int pid, void *dst, uint64_t addr,
                                size_t len) {
  return peer_move(s, ex, p, pid, dst, addr, len, 0);
}

t3d_result_t t3d__shm_write_peer(t3d_shm_t *s, t3d_exec_t *ex, int p, int pid, uint64_t addr, const void *src,
                                 size_t len) {
  return peer_move(s, ex, p, pid, (void *)(uintptr_t)src, addr, len, 1);
}
