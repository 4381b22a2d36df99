/* broadcast.c: broadcast over a communicator's shared-memory segment: the root writes the buffer into its half a
 * step at a time, double-buffered, or a small one into the next small slot, and the others copy it out; or, in the
 * single-copy range, straight between the ranks' buffers, the root and its readers each copying part; also, for
 * what fits one half or is single copy, in parts for the inline path. */
#include "shm.h"

#include <string.h>
#include <time.h>

/* A small broadcast takes one step in the next small slot (a root may then run T3D_SHM_SMALL_SLOTS broadcasts
 * ahead of its slowest reader instead of two); a larger one steps through the halves. */
static void bcast_step_begin(t3d_shm_t *s, size_t bytes, t3d_shm_step_t *st) {
  if (bytes <= T3D_SHM_SMALL_BYTES) t3d__shm_step_begin_small(s, 2, st);
  else t3d__shm_step_begin(s, 2, st);
}

/* A broadcast of at most T3D_SHM_INLINE_DATA bytes travels in the root's info line of its slot, which its readers
 * wait on anyway: one line crosses per reader instead of two (allreduce.c's one-shot does the same). */
static int bcast_inline(size_t bytes) { return bytes <= T3D_SHM_INLINE_DATA; }

/* From this size the root writes its half with non-temporal stores, which send the lines to memory instead of
 * leaving them modified in the root's caches. Where the two ranks' CPUs sit on different core complexes of the
 * host, a reader otherwise fetches every line from the other complex's cache: measured at 2 ranks on data on an
 * AMD EPYC (docs/benchmarks/broadcast-root-nt-2ranks.txt), far 32 KiB-32 MiB 6-10x faster (32 MiB 14.3 -> 1.7
 * ms), near 32-128 KiB 1.5x faster, 512 KiB-8 MiB 1.2-2x slower. Not on CPUs whose cores share one L3
 * (s->handoff_nt: Intel's; docs/architecture.md, "Not on Intel CPUs"). */
#define ROOT_NT_MIN (32u * 1024u)
/* From this size a group that times its placement (t3d__shm_far: two ranks with a core each) asks first, and the
 * root writes plain stores where the ranks sit near each other; the probe's microsecond or two is a few per cent
 * of a 512 KiB broadcast. */
#define ROOT_PROBE_MIN (512u * 1024u)

static int bcast_probes(const t3d_shm_t *s, size_t bytes) { return t3d__shm_probes_from(s, bytes, ROOT_PROBE_MIN); }

/* The root's writes of a step: [lo, lo + len) of the buffer into its half (nt: with non-temporal stores), and its
 * info line on the first step. */
static void root_write(t3d_shm_t *s, const t3d_shm_step_t *st, const char *b, size_t lo, size_t len, size_t bytes,
                       int nt) {
  if (bcast_inline(bytes)) {
    t3d__shm_put_inline(s, st, T3D_OP_BROADCAST, bytes, b, bytes);
    return;
  }
  t3d__shm_copy(t3d__shm_half(s, s->rank, st->h), b + lo, len, nt);
  if (lo == 0) t3d__shm_put_info(s, st, T3D_OP_BROADCAST, bytes, 0); /* next to root_post's seq: written at once */
}

/* Where a reader finds the root's data of step st. */
static const char *root_data(t3d_shm_t *s, const t3d_shm_step_t *st, int root, size_t bytes) {
  return bcast_inline(bytes) ? t3d__shm_inline_data(s, root, st->h) : t3d__shm_half(s, root, st->h);
}

/* t3d__shm_next_half_free for the next small slot. */
static int next_small_free(t3d_shm_t *s) {
  return t3d__shm_all_past(s, s->free_small[s->small_steps % T3D_SHM_SMALL_SLOTS]);
}

/* The root has nothing to read: it posts both phases of its step at once, and sets seq of the step's info line to
 * phase 1, on which the others wait (t3d__shm_post_arrived): they then read the root's flag line only now and
 * then, and the root, which runs ahead by up to T3D_SHM_SMALL_SLOTS small broadcasts, writes a line nobody reads
 * meanwhile. On the operation's first step the root shows phase 1 before it posts phase 2 and looks for a second
 * root in between (t3d__shm_check_sole_writer): until it posts phase 2 no peer may write that slot again. */
static t3d_result_t root_post(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, size_t bytes, int first) {
  if (first) {
    t3d__shm_post_lazy(s, st->base + 1);
    t3d__shm_show_arrived(s, st);
    atomic_thread_fence(memory_order_seq_cst);
    T3D_CHECK(t3d__shm_check_sole_writer(s, ex, st, T3D_OP_BROADCAST, bytes));
  }
  t3d__shm_post(s, st->base + 2);
  if (!first) t3d__shm_show_arrived(s, st);
  return T3D_OK;
}

static t3d_result_t wait_root(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, int root) {
  t3d_shm_arrival_t a = t3d__shm_arrival(st);
  return t3d__shm_wait_line(s, ex, root, st->base + 1, 0, &a);
}

/* ---------- single copy (t3d__shm_use_bcast_direct) ----------
 * One step, with both sides copying: every rank says where its buffer is (info line) and posts phase 1; the root
 * also shows the phase in its line and checks, as root_post does, that no other rank names itself the root. A
 * reader then reads the head of the buffer, [0, split), from the root's process, while the root writes the tail
 * into each reader's process (direct.c); each posts phase 2 when done and returns only once all have (the root's
 * buffer may change after that, t3d__shm_direct_end). The readers' phase 1 is what the root's inline start waits
 * for. The tail is the root's share: a 1/n-th per reader, in whole pages, so that the root and the n - 1 readers
 * each move about (n - 1) / n of the bytes. */
static size_t direct_split(const t3d_shm_t *s, size_t bytes) {
  return bytes - (bytes / (size_t)s->size & ~(size_t)(T3D_SHM_PAGE - 1));
}

static t3d_result_t direct_publish(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, void *buf, size_t bytes,
                                   int root) {
  T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
  t3d__shm_put_info(s, st, T3D_OP_BROADCAST, bytes, 0);
  t3d__shm_put_addr(s, st, buf);
  t3d__shm_post(s, st->base + 1); /* waking sleepers: the next post comes only after the peers' */
  if (s->rank != root) return T3D_OK;
  t3d__shm_show_arrived(s, st);
  atomic_thread_fence(memory_order_seq_cst);
  return t3d__shm_check_sole_writer(s, ex, st, T3D_OP_BROADCAST, bytes);
}

typedef struct {
  t3d_shm_t *s;
  t3d_exec_t *ex;
  const t3d_shm_step_t *st;
  const char *src;
  size_t split, bytes;
  t3d_result_t res;
} tail_ctx_t;

/* The root, for reader p once it has posted phase 1: the tail into p's buffer. */
static void write_tail(void *arg, int p) {
  tail_ctx_t *c = arg;
  if (c->res == T3D_OK) c->res = t3d__shm_check_info(c->s, c->ex, c->st, p, T3D_OP_BROADCAST, c->bytes);
  if (c->res != T3D_OK) return;
  const t3d_shm_info_t *in = t3d__shm_info(c->s, p, c->st->h);
  c->res = t3d__shm_write_peer(c->s, c->ex, p, (int)in->pid, in->addr + c->split, c->src + c->split,
                               c->bytes - c->split);
}

/* How long a reader whose step failed waits for the root to stop writing into its buffer (drain_root). */
#define ROOT_DRAIN_NS (5ull * 1000000000ull)

/* A reader whose step failed (a wait timed out, or the group broke) must not return while the root may still write
 * into its buffer, which the caller may free once the call returns. The root writes only before it posts phase 2:
 * wait for that post, or for its process to be gone, whatever the group's state, for at most ROOT_DRAIN_NS. */
static void drain_root(t3d_shm_t *s, int root, uint64_t done) {
  uint64_t until = t3d__now_ns() + ROOT_DRAIN_NS;
  int32_t pid = atomic_load_explicit(t3d__shm_pid(s, root), memory_order_acquire);
  while (atomic_load_explicit(t3d__shm_flag(s, root), memory_order_acquire) < done) {
    if ((pid > 0 && t3d__shm_process_gone(pid)) || t3d__now_ns() >= until) return;
    struct timespec nap = {0, 100000};
    nanosleep(&nap, NULL);
  }
}

/* After direct_publish (and, on a reader, the root's phase 1): this rank's share, then the step's end. */
static t3d_result_t direct_move(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, void *buf, size_t bytes,
                                int root) {
  size_t split = direct_split(s, bytes);
  t3d_result_t res;
  if (s->rank == root) {
    tail_ctx_t c = {s, ex, st, buf, split, bytes, T3D_OK};
    res = t3d__shm_wait_each(s, ex, st->base + 1, NULL, write_tail, &c);
    if (res == T3D_OK) res = c.res;
    return t3d__shm_direct_end(s, ex, st->base + 2, res);
  }
  res = wait_root(s, ex, st, root);
  if (res == T3D_OK) res = t3d__shm_check_info(s, ex, st, root, T3D_OP_BROADCAST, bytes);
  const t3d_shm_info_t *in = t3d__shm_info(s, root, st->h);
  if (res == T3D_OK) res = t3d__shm_read_peer(s, ex, root, (int)in->pid, buf, in->addr, split);
  res = t3d__shm_direct_end(s, ex, st->base + 2, res);
  if (res != T3D_OK) drain_root(s, root, st->base + 2);
  return res;
}

static t3d_result_t direct_broadcast(t3d_shm_t *s, t3d_exec_t *ex, void *buf, size_t bytes, int root) {
  t3d_shm_step_t st;
  t3d__shm_step_begin(s, 2, &st);
  T3D_CHECK(direct_publish(s, ex, &st, buf, bytes, root));
  return direct_move(s, ex, &st, buf, bytes, root);
}

t3d_result_t t3d__shm_broadcast(t3d_exec_t *ex, void *buf, size_t bytes, int root) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  char *b = buf;
  if (t3d__shm_mapped_size(s, bytes)) {
    int done = 0;
    T3D_CHECK(t3d__shm_mapped_broadcast(s, ex, buf, bytes, root, &done));
    if (done) return T3D_OK;
  }
  if (t3d__shm_use_bcast_direct(s, bytes)) return direct_broadcast(s, ex, buf, bytes, root);
  int nt = s->nt && bytes >= s->nt_min;
  int root_nt = s->handoff_nt && bytes >= ROOT_NT_MIN;
  if (bcast_probes(s, bytes)) T3D_CHECK(t3d__shm_far(s, ex, 1, bytes, &root_nt));
  for (size_t lo = 0; lo < bytes; lo += s->half) {
    size_t len = t3d__shm_min_sz(s->half, bytes - lo);
    t3d_shm_step_t st;
    bcast_step_begin(s, bytes, &st);
    if (s->rank == root) {
      T3D_CHECK(t3d__shm_step_acquire(s, ex, &st));
      root_write(s, &st, b, lo, len, bytes, root_nt);
      T3D_CHECK(root_post(s, ex, &st, bytes, lo == 0));
    } else {
      T3D_CHECK(wait_root(s, ex, &st, root));
      if (lo == 0) T3D_CHECK(t3d__shm_check_info(s, ex, &st, root, T3D_OP_BROADCAST, bytes));
      t3d__shm_copy(b + lo, root_data(s, &st, root, bytes), len, nt);
      t3d__shm_post(s, st.base + 2);
    }
  }
  return T3D_OK;
}

/* A broadcast that fits one half, in parts: the root publishes and is done; the others wait for it, then copy out.
 * The same steps as t3d__shm_broadcast, so ranks that take either path agree. */
/* The root of a small broadcast: the lines of the next small slot (as t3d__shm_oneshot_warm). Measured, 2 ranks:
 * 128 B-512 B 0.42-0.46 -> 0.38-0.41 us, 2 KiB 0.74 -> 0.60 us. */
void t3d__shm_bcast_warm(t3d_shm_t *s, size_t bytes) {
  if (bytes == 0 || bytes > T3D_SHM_SMALL_BYTES) return;
  int h = 2 + (int)(s->small_steps % T3D_SHM_SMALL_SLOTS);
  t3d__shm_prefetch_write(t3d__shm_info(s, s->rank, h));
  const char *slot = t3d__shm_half(s, s->rank, h);
  for (size_t off = 0; !bcast_inline(bytes) && off < bytes && off < 4 * 64; off += 64)
    t3d__shm_prefetch_write(slot + off);
}

int t3d__shm_bcast_fits(t3d_shm_t *s, size_t bytes, int root) {
  if (bytes == 0 || t3d__shm_mapped_size(s, bytes)) return 0;
  if (t3d__shm_use_bcast_direct(s, bytes)) return t3d__shm_next_half_free(s); /* every rank writes its line */
  if (bytes > s->half || bcast_probes(s, bytes)) return 0;
  return root != s->rank || (bytes <= T3D_SHM_SMALL_BYTES ? next_small_free(s) : t3d__shm_next_half_free(s));
}

t3d_result_t t3d__shm_bcast_start(t3d_exec_t *ex, const void *buf, size_t bytes, int root, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  t3d_shm_step_t st;
  int direct = t3d__shm_use_bcast_direct(s, bytes);
  if (direct) t3d__shm_step_begin(s, 2, &st);
  else bcast_step_begin(s, bytes, &st);
  rs->h = st.h;
  rs->base = st.base;
  rs->by_line = s->rank != root; /* the root of single copy waits for its readers' flags */
  if (direct) return direct_publish(s, ex, &st, (void *)(uintptr_t)buf, bytes, root);
  if (s->rank != root) return T3D_OK;
  T3D_CHECK(t3d__shm_step_acquire(s, ex, &st)); /* free: t3d__shm_bcast_fits checked */
  root_write(s, &st, buf, 0, bytes, bytes, s->handoff_nt && bytes >= ROOT_NT_MIN);
  return root_post(s, ex, &st, bytes, 1);
}

t3d_result_t t3d__shm_bcast_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, void *buf, size_t bytes, int root) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  t3d_shm_step_t st = {rs->h, rs->base, 0, 1};
  if (t3d__shm_use_bcast_direct(s, bytes)) return direct_move(s, ex, &st, buf, bytes, root);
  T3D_CHECK(wait_root(s, ex, &st, root));
  T3D_CHECK(t3d__shm_check_info(s, ex, &st, root, T3D_OP_BROADCAST, bytes));
  memcpy(buf, root_data(s, &st, root, bytes), bytes);
  t3d__shm_post(s, st.base + 2);
  return T3D_OK;
}
