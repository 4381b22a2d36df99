/* sync.c: the flag protocol the shared-memory collectives are built from: steps and the phases they hand out, which
 * half or small slot a step uses and when it may be written again, posting a phase, sleeping on a peer's flag and
 * waking the sleepers on this rank's (futex), the waits (one rank, every rank, or each rank as it arrives; on flags
 * or on the info lines of one-shot steps), and the info lines through which ranks check that they run the same
 * operation. */
#include "shm.h"

#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ---------- steps ---------- */

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
  uint64_t least = UINT64_MAX;
  for (int p = 0; p < s->size; p++) {
    if (p == s->rank) continue;
    uint64_t v = atomic_load_explicit(t3d__shm_flag(s, p), memory_order_acquire);
    if (v < need) return 0;
    if (v < least) least = v;
  }
  /* Flags only grow: what they show now answers the next checks too, until a step needs more. */
  s->seen_all = least != UINT64_MAX ? least : need;
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
  t3d__shm_set_cpu(s, 0u); /* asleep, this rank runs nowhere: peers must not spin for it */
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

/* cpu_aware: rank p shows a CPU other than this rank's (it runs there now, unless preempted since). */
static int runs_elsewhere(t3d_shm_t *s, int p) {
  uint32_t cpu = atomic_load_explicit(t3d__shm_cpu(s, p), memory_order_relaxed);
  return cpu != 0 && cpu != (uint32_t)sched_getcpu() + 1u;
}

void t3d__shm_backoff(t3d_shm_t *s, t3d_backoff_t *b, int p, uint64_t target, uint64_t until) {
  int running = 0;
  if (s->cpu_aware) {
    if (b->since == 0) t3d__shm_note_cpu(s); /* starting to wait: this rank runs here now */
    running = runs_elsewhere(s, p);
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

int t3d__shm_peer_running(t3d_shm_t *s) {
  if (!s->cpu_aware) return 0;
  uint32_t mine = (uint32_t)sched_getcpu() + 1u;
  t3d__shm_set_cpu(s, mine);
  for (int p = 0; p < s->size; p++) {
    uint32_t cpu = p == s->rank ? 0u : atomic_load_explicit(t3d__shm_cpu(s, p), memory_order_relaxed);
    if (cpu != 0 && cpu != mine) return 1;
  }
  return 0;
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

/* ---------- failures of other ranks ---------- */

static t3d_shm_header_t *header(const t3d_shm_t *s) { return (t3d_shm_header_t *)(void *)s->base; }

void t3d__shm_report_failure(t3d_shm_t *s, t3d_result_t res, const char *msg) {
  t3d_shm_header_t *h = header(s);
  uint64_t none = 0;
  if (!atomic_compare_exchange_strong(&h->failed, &none, (uint64_t)s->rank + 1)) return; /* someone was first */
  h->failed_code = (int64_t)res;
  snprintf(h->failed_msg, sizeof h->failed_msg, "%s", msg != NULL ? msg : "");
  atomic_store_explicit(&h->failed_ready, 1, memory_order_release);
}

/* Another rank's report that the communicator broke, as this operation's error; T3D_OK when there is none. */
static t3d_result_t reported(t3d_shm_t *s, t3d_exec_t *ex) {
  const t3d_shm_header_t *h = header(s);
  uint64_t f = atomic_load_explicit(&h->failed, memory_order_acquire);
  if (f != 0 && f != (uint64_t)s->rank + 1) {
    int ready = atomic_load_explicit(&h->failed_ready, memory_order_acquire) != 0;
    /* The reporter writes its text right after it claims the word: wait for it a little (the reporter may have died
     * in between, hence the bound). */
    for (uint64_t until = t3d__now_ns() + 100000000ull; !ready && t3d__now_ns() < until;) {
      sched_yield();
      ready = atomic_load_explicit(&h->failed_ready, memory_order_acquire) != 0;
    }
    int n = snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d) failed: rank %d broke "
                     "the group: ", ex->opname, (unsigned long long)ex->seq, ex->comm->name, ex->rank, ex->size,
                     (int)(f - 1));
    /* Its text in whatever room is left (the two together may be longer than one error). */
    size_t used = n > 0 && (size_t)n < sizeof ex->error ? (size_t)n : sizeof ex->error - 1;
    const char *why = ready ? h->failed_msg : "(its error is being written)";
    size_t len = strnlen(why, sizeof ex->error - 1 - used);
    memcpy(ex->error + used, why, len);
    ex->error[used + len] = '\0';
    return ready && h->failed_code < 0 ? (t3d_result_t)h->failed_code : T3D_ERR_ABORTED;
  }
  return T3D_OK;
}

/* Checked between polls of a wait (every 16th round, after abort and deadline): another rank reported that the
 * communicator broke (its error becomes this operation's), or a rank awaited here has no process any more (checked
 * every s->liveness_ns; ranks that are threads of this process, or whose process id is not written yet, are not). */
static t3d_result_t check_peers(t3d_shm_t *s, t3d_exec_t *ex, int lo, int hi, uint64_t target) {
  t3d_result_t res = reported(s, ex);
  if (res != T3D_OK || s->liveness_ns == 0) return res;
  uint64_t now = t3d__now_ns();
  if (now - s->alive_checked < s->liveness_ns) return T3D_OK;
  s->alive_checked = now;
  for (int p = lo; p < hi; p++) {
    if (p == s->rank || atomic_load_explicit(t3d__shm_flag(s, p), memory_order_acquire) >= target) continue;
    int32_t pid = atomic_load_explicit(t3d__shm_pid(s, p), memory_order_acquire);
    if (pid <= 0 || pid == (int32_t)s->pid || !t3d__shm_process_gone(pid)) continue;
    /* A rank that failed reports it before it can exit: its report, if it made one since the check above, says
     * more than its death does. */
    if ((res = reported(s, ex)) != T3D_OK) return res;
    char names[256];
    describe_missing(s, lo, hi, target, names, sizeof names);
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d) lost rank %d: its process "
             "(pid %d) has exited; still waiting for %s", ex->opname, (unsigned long long)ex->seq, ex->comm->name,
             ex->rank, ex->size, p, (int)pid, names);
    return T3D_ERR_PEER_LOST;
  }
  return T3D_OK;
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

t3d_result_t t3d__shm_wait_until(t3d_shm_t *s, t3d_exec_t *ex, int who, uint64_t target, uint64_t limit_ns) {
  return t3d__shm_wait_line(s, ex, who, target, limit_ns, NULL);
}

/* Polls of a wait before it first reads the clock (each poll then a pause, 27 ns here): a peer that runs on another
 * core and is on its way arrives within a few hundred nanoseconds, and two clock reads (the operation's deadline
 * and the backoff's start, 23 ns each here) had been a tenth of a small collective. */
enum { QUICK_POLLS = 32 };

/* Whether a waiter for rank p may spin now rather than give up its core (as t3d__shm_backoff decides). */
static int may_spin(t3d_shm_t *s, int p) { return s->cpu_aware ? runs_elsewhere(s, p) : !t3d__cores_filled(); }

/* The first polls of a wait for ranks [*next, hi), without the clock: moves *next past those that arrive; 1 when
 * all have. Peers that are not running elsewhere are not spun for. */
static int quick_wait(t3d_shm_t *s, int *next, int hi, uint64_t target, const t3d_shm_arrival_t *a) {
  for (int k = 0; k < QUICK_POLLS; k++) {
    while (*next < hi && (*next == s->rank || arrived(s, *next, target, a, 0))) ++*next;
    if (*next == hi) return 1;
    if (k == 0 && !may_spin(s, *next)) return 0;
    __builtin_ia32_pause();
  }
  return 0;
}

t3d_result_t t3d__shm_wait_line(t3d_shm_t *s, t3d_exec_t *ex, int who, uint64_t target, uint64_t limit_ns,
                                const t3d_shm_arrival_t *a) {
  int lo = who < 0 ? 0 : who, hi = who < 0 ? s->size : who + 1;
  int next = lo; /* flags only grow: a rank seen at target stays there */
  if (quick_wait(s, &next, hi, target, a)) goto done;
  uint64_t until = limit_ns != 0 ? t3d__now_ns() + limit_ns : 0;
  t3d_backoff_t b = {.quick = 1};
  for (unsigned it = 1;; it++) {
    int before = next;
    while (next < hi && (next == s->rank || arrived(s, next, target, a, (it & 15) == 0))) next++;
    if (next == hi) break;
    if (next != before) t3d__backoff_reset(&b);
    if ((it & 15) == 0) {
      if (t3d__exec_check(ex, "") != T3D_OK) return fail_wait(s, ex, lo, hi, target);
      T3D_CHECK(check_peers(s, ex, lo, hi, target));
    }
    /* Every 8th round: a clock read costs a fair share of a sub-microsecond collective. */
    if (until != 0 && (it & 7) == 0 && t3d__now_ns() >= until) return T3D_IN_PROGRESS;
    t3d__shm_backoff(s, &b, next, target, until);
    /* In the spin phase, watch the awaited rank in a tight loop before the next round: a round (clock read, CPU
     * check, point-to-point pass, 8 pauses) takes ~150 ns, which a sub-microsecond collective would wait out. */
    for (int k = 0; b.spun && k < 32 && !arrived(s, next, target, a, 0); k++) __builtin_ia32_pause();
  }
done:
  if (who < 0 && target > s->seen_all) s->seen_all = target;
  return T3D_OK;
}

t3d_result_t t3d__shm_wait_each(t3d_shm_t *s, t3d_exec_t *ex, uint64_t target, const t3d_shm_arrival_t *a,
                               t3d_shm_peer_fn fn, void *arg) {
  int n = s->size, cnt = 0;
  for (int i = 1; i < n; i++) s->pending[cnt++] = (s->rank + i) % n;
  t3d_backoff_t b = {.quick = 1};
  for (unsigned it = 1; cnt > 0; it++) {
    int progressed = 0;
    for (int i = 0; i < cnt;) {
      int p = s->pending[i];
      if (arrived(s, p, target, a, (it & 15) == 0)) {
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
    if ((it & 15) == 0) {
      if (t3d__exec_check(ex, "") != T3D_OK) return fail_wait(s, ex, 0, n, target);
      T3D_CHECK(check_peers(s, ex, 0, n, target));
    }
    t3d__shm_backoff(s, &b, s->pending[0], target, 0);
  }
  if (target > s->seen_all) s->seen_all = target;
  return T3D_OK;
}

/* The wait between start and finish of every collective that runs in parts (t3d_internal.h). */
t3d_result_t t3d__shm_start_wait(t3d_exec_t *ex, const t3d_shm_resume_t *rs, int who, uint64_t limit_ns) {
  /* Only a start whose peers set seq (rs->by_line) looks beyond the flags: the other starts would pay a miss on a
   * line that never says more. */
  t3d_shm_t *s = t3d__exec_shm(ex);
  if (!rs->by_line) return t3d__shm_wait_line(s, ex, who, rs->base + 1, limit_ns, NULL);
  t3d_shm_arrival_t a = {rs->h, rs->base + 1};
  return t3d__shm_wait_line(s, ex, who, rs->base + 1, limit_ns, &a);
}

/* ---------- placement (shm.h, t3d__shm_far) ---------- */

enum {
  PROBE_ROUNDS = 8, /* the first two are not timed: the ranks meet in the first, the second starts the clock */
  PROBE_SPINS = 4096, /* polls of the peer's flag in a round before the probe gives up timing and just waits */
  PROBE_EVERY = 16    /* one probe per this many operations that may probe; the others keep the last answer */
};

/* The median of the timed rounds: one round that an interrupt or a preemption stretched does not decide. */
static uint64_t median_round(uint64_t *v, int n) {
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
      uint64_t t = v[j];
      v[j] = v[j - 1];
      v[j - 1] = t;
    }
  return (v[(n - 1) / 2] + v[n / 2]) / 2;
}

/* One probe: sets s->far_now from the median round, unless a round went untimed (then the last answer stays). */
static t3d_result_t probe_placement(t3d_shm_t *s, t3d_exec_t *ex) {
  int peer = 1 - s->rank; /* place_min is 0 unless the group has two ranks */
  s->probes++;
  t3d_shm_step_t st;
  t3d__shm_step_begin(s, PROBE_ROUNDS, &st); /* writes no half: nothing to acquire */
  uint64_t round_ns[PROBE_ROUNDS - 2], last = 0;
  int timed = 1;
  for (int k = 1; k <= PROBE_ROUNDS; k++) {
    t3d__shm_post(s, st.base + (uint64_t)k);
    if (k == 1) { /* the ranks meet: one may still be busy with the previous operation */
      T3D_CHECK(t3d__shm_wait_until(s, ex, peer, st.base + 1, 0));
      continue;
    }
    const _Atomic uint64_t *f = t3d__shm_flag(s, peer);
    int spins = 0;
    while (atomic_load_explicit(f, memory_order_acquire) < st.base + (uint64_t)k) {
      if (++spins < PROBE_SPINS) {
        __builtin_ia32_pause();
        continue;
      }
      timed = 0; /* the peer is late or descheduled: this probe measures nothing */
      T3D_CHECK(t3d__shm_wait_until(s, ex, peer, st.base + (uint64_t)k, 0));
      break;
    }
    uint64_t now = t3d__now_ns();
    if (k > 2) round_ns[k - 3] = now - last; /* round 2 only starts the clock */
    last = now;
  }
  uint64_t median = timed ? median_round(round_ns, PROBE_ROUNDS - 2) : 0;
  if (s->far_ns == 0) s->far_now = 1;
  else if (timed) s->far_now = median > s->far_ns;
  T3D_TRACE("group '%s' rank %d: placement probe: %llu ns a round (0: not timed), %s", ex->comm->name, s->rank,
            (unsigned long long)median, s->far_now ? "far" : "near");
  return T3D_OK;
}

t3d_result_t t3d__shm_far(t3d_shm_t *s, t3d_exec_t *ex, int probe, size_t bytes, int *far) {
  *far = 0;
  if (!probe || s->place_min == 0) return T3D_OK;
  /* Every rank counts the same operations, so all probe at the same ones. Each probe makes the ranks meet, which
   * costs a broadcast root the lead it may otherwise keep over its reader (measured, 32 MiB back to back: 2.1 ms
   * a broadcast without probes, 3.0-3.6 with one each). */
  if (bytes >= T3D_SHM_PROBE_EACH_BYTES || s->may_probe++ % PROBE_EVERY == 0) T3D_CHECK(probe_placement(s, ex));
  *far = s->far_now && s->nt;
  return T3D_OK;
}

/* ---------- info lines ---------- */

void t3d__shm_put_info(t3d_shm_t *s, const t3d_shm_step_t *st, int kind, uint64_t sig, uint64_t aux) {
  t3d_shm_info_t *in = t3d__shm_info(s, s->rank, st->h);
  in->kind = t3d__shm_info_kind(s, kind);
  in->sig = sig;
  in->aux = aux;
  in->addr = 0;
  in->pid = s->pid;
}

t3d_result_t t3d__shm_check_info(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, int peer, int kind,
                                 uint64_t sig) {
  const t3d_shm_info_t *in = t3d__shm_info(s, peer, st->h);
  if (in->kind == t3d__shm_info_kind(s, kind) && in->sig == sig) return T3D_OK;
  int n = snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d): ", ex->opname,
                   (unsigned long long)ex->seq, ex->comm->name, ex->rank, ex->size);
  size_t used = n > 0 && (size_t)n < sizeof ex->error ? (size_t)n : sizeof ex->error - 1;
  if (t3d__shm_kind_seq(in->kind) == (ex->seq & 0xfffffffull)) {
    /* The same collective, another kind, size, dtype, reduce op or root. */
    char theirs[96], ours[96];
    t3d__fingerprint_text(t3d__shm_kind_fp(in->kind), theirs, sizeof theirs);
    t3d__fingerprint_text(s->op_fp, ours, sizeof ours);
    const char *what = t3d__shm_kind_op(in->kind) != kind ? "the operation"
                       : in->sig != sig                  ? "its size"
                                                         : "its dtype, reduce op or root";
    snprintf(ex->error + used, sizeof ex->error - used, "rank %d runs %s of %llu bytes (%s) where this rank runs %s of "
             "%llu bytes (%s) (ranks disagree on %s)", peer, t3d__op_name((t3d_op_kind_t)t3d__shm_kind_op(in->kind)),
             (unsigned long long)in->sig, theirs, ex->opname, (unsigned long long)sig, ours, what);
  } else {
    /* The peer posted this step's phase without writing this line: it runs a collective that uses another part of
     * the segment; its current one says which. */
    uint64_t w = atomic_load_explicit(t3d__shm_opline(s, peer), memory_order_relaxed);
    snprintf(ex->error + used, sizeof ex->error - used, "rank %d runs %s #%llu where this rank runs %s of %llu bytes "
             "(ranks disagree on the operation)", peer, t3d__op_name((t3d_op_kind_t)t3d__shm_kind_op(w)),
             (unsigned long long)t3d__shm_kind_seq(w), ex->opname, (unsigned long long)sig);
  }
  return T3D_ERR_MISMATCH;
}

t3d_result_t t3d__shm_check_all_info(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, int kind,
                                     uint64_t sig) {
  for (int p = 0; p < s->size; p++)
    if (p != s->rank) T3D_CHECK(t3d__shm_check_info(s, ex, st, p, kind, sig));
  return T3D_OK;
}

t3d_result_t t3d__shm_check_sole_writer(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, int kind,
                                        uint64_t sig) {
  for (int p = 0; p < s->size; p++) {
    if (p == s->rank) continue;
    /* Phases are never handed out twice: this step's phase in a peer's line was put there in this step. */
    if (atomic_load_explicit(&t3d__shm_info(s, p, st->h)->seq, memory_order_acquire) != st->base + 1) continue;
    T3D_CHECK(t3d__shm_check_info(s, ex, st, p, kind, sig));
  }
  return T3D_OK;
}
