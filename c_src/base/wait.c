/* wait.c: how every wait of t3d passes time: spin briefly, then yield, then block (ranks often outnumber cores). */
#include "t3d_internal.h"

#include <sched.h>
#include <time.h>
#include <unistd.h>


/* Time since the last sign of progress decides: pause-spin for a few microseconds (T3D_SPIN_NS, 5 us: a streaming
 * peer answers within that), then yield (T3D_YIELD_NS, 2 ms: lets the peer run when ranks outnumber cores), then
 * block: on the waiter's own wake-up signal where it has one (shared-memory flags: a futex), otherwise in short naps.
 * When this host runs as many ranks as it has cores or more, the peer we wait for is often queued behind us on our
 * own core (measured: two ranks on two cores share one about half the time, as the scheduler places a woken task
 * next to its waker): the spin phase is skipped, except by a shared-memory waiter that sees its peer running on
 * another CPU (t3d__backoff_poll_running, shm.h's t3d__shm_cpu). With more ranks than cores every polling thread also takes turns
 * from the ranks that have work: the yield phase is cut to T3D_YIELD_NS_OVERSUBSCRIBED (200 us) and the idle
 * progress thread stops watching its queue (t3d__backoff_note_ranks, t3d__oversubscribed). With exactly as many, a rank still has
 * about a core to itself, and blocking would cost a wake-up per step of a pipelined operation (measured, 2 ranks:
 * small broadcast 22 -> 45 us, 64 MiB allreduce 86% -> 73% of its bound). */
static _Atomic int64_t spin_ns = -1;  /* -1: not decided yet */
static _Atomic int64_t yield_ns = -1; /* -1: not decided yet */
static _Atomic int64_t running_spin_ns = -1; /* t3d__backoff_poll_running: T3D_SPIN_NS even when the cores are full */
static atomic_int oversubscribed;

static int64_t budget(_Atomic int64_t *slot, t3d_param_id_t id) {
  int64_t v = atomic_load_explicit(slot, memory_order_relaxed);
  if (v < 0) {
    v = t3d__param_int(id);
    if (v < 0) v = 0;
    int64_t expected = -1;
    atomic_compare_exchange_strong(slot, &expected, v);
    v = atomic_load_explicit(slot, memory_order_relaxed);
  }
  return v;
}

void t3d__backoff_note_ranks(int local_ranks) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) < cpus) cpus = CPU_COUNT(&set);
  if (cpus <= 0 || local_ranks < cpus) return;
  /* Values the user set stay. */
  if (!t3d__param_is_set(T3D_PARAM_SPIN_NS)) atomic_store_explicit(&spin_ns, 0, memory_order_relaxed);
  if (local_ranks == cpus) return;
  atomic_store(&oversubscribed, 1);
  if (!t3d__param_is_set(T3D_PARAM_YIELD_NS)) {
    atomic_store_explicit(&yield_ns, t3d__param_int(T3D_PARAM_YIELD_NS_OVERSUBSCRIBED), memory_order_relaxed);
  }
}

int t3d__oversubscribed(void) { return atomic_load(&oversubscribed); }

void t3d__backoff_reset(t3d_backoff_t *b) { b->since = 0; }

/* One poll: pause-spin while idle < spin (setting *spun), `pauses` pauses, then yield, then 1. */
static int backoff_step(uint64_t *since, uint64_t spin, int *spun, int pauses) {
  uint64_t now = t3d__now_ns();
  if (*since == 0) *since = now;
  uint64_t idle = now - *since;
  if (idle < spin) {
    for (int i = 0; i < pauses; i++) __builtin_ia32_pause();
    if (spun != NULL) *spun = 1;
    return 0;
  }
  if (idle < spin + (uint64_t)budget(&yield_ns, T3D_PARAM_YIELD_NS)) {
    sched_yield();
    return 0;
  }
  return 1;
}

static int pauses_of(const t3d_backoff_t *b) { return b != NULL && b->quick ? 1 : T3D_SPIN_PAUSES; }

int t3d__backoff_poll(t3d_backoff_t *b) {
  b->spun = 0;
  return backoff_step(&b->since, (uint64_t)budget(&spin_ns, T3D_PARAM_SPIN_NS), &b->spun, pauses_of(b));
}

int t3d_backoff_poll(uint64_t *since) {
  return backoff_step(since, (uint64_t)budget(&spin_ns, T3D_PARAM_SPIN_NS), NULL, T3D_SPIN_PAUSES);
}

/* One poll of a waiter whose peer runs on another CPU: pause-spin for T3D_SPIN_NS whatever the cores, then as
 * backoff_step. */
static int running_step(uint64_t *since, int *spun, int pauses) {
  uint64_t now = t3d__now_ns();
  if (*since == 0) *since = now;
  if (now - *since < (uint64_t)budget(&running_spin_ns, T3D_PARAM_SPIN_NS)) {
    for (int i = 0; i < pauses; i++) __builtin_ia32_pause();
    if (spun != NULL) *spun = 1;
    return 0;
  }
  return backoff_step(since, (uint64_t)budget(&spin_ns, T3D_PARAM_SPIN_NS), spun, pauses);
}

int t3d__backoff_poll_running(t3d_backoff_t *b) {
  b->spun = 0;
  return running_step(&b->since, &b->spun, pauses_of(b));
}

int t3d__backoff_poll_p2p(uint64_t *since, int running) {
  if (running) return running_step(since, NULL, 1);
  return backoff_step(since, (uint64_t)budget(&spin_ns, T3D_PARAM_SPIN_NS), NULL, 1);
}

int t3d__cores_filled(void) { return atomic_load_explicit(&spin_ns, memory_order_relaxed) == 0; }

void t3d__backoff_wait(t3d_backoff_t *b) {
  if (t3d__backoff_poll(b)) {
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
}

