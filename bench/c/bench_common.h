/* bench_common.h: what t3d_bench_c and mpi_bench_c share, so that the two compare the same thing: the operations,
 * the element counts a size gives, the inputs, the expected outputs, nccl-tests' bus factors and the size parser. */
#ifndef T3D_BENCH_COMMON_H
#define T3D_BENCH_COMMON_H

#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { OP_ALLREDUCE, OP_ALLGATHER, OP_REDUCE_SCATTER, OP_ALLTOALL, OP_BROADCAST, OP_SENDRECV, OP_COUNT };
static const char *const op_names[OP_COUNT] = {"allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast",
                                               "sendrecv"};

/* Whether op reduces (float32 sum, the "redop" column); the others only move data. */
static inline int op_reduces(int op) { return op == OP_ALLREDUCE || op == OP_REDUCE_SCATTER; }

/* "allreduce, allgather, ..." for the usage texts. */
static inline void print_op_names(FILE *f) {
  for (int i = 0; i < OP_COUNT; i++) fprintf(f, "%s%s", i > 0 ? ", " : "", op_names[i]);
}

/* "64K", "1.5M", "2G": bytes. */
static inline size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  switch (*end) {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1024 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return (size_t)v;
}

/* "allreduce,sendrecv" into ops[] (1 for each one named); 0 when a name is unknown. */
static inline int parse_ops(const char *list, int ops[OP_COUNT]) {
  for (int i = 0; i < OP_COUNT; i++) ops[i] = 0;
  char *copy = strdup(list);
  int ok = copy != NULL;
  for (char *tok = ok ? strtok(copy, ",") : NULL; tok != NULL && ok; tok = strtok(NULL, ",")) {
    ok = 0;
    for (int i = 0; i < OP_COUNT; i++)
      if (strcmp(tok, op_names[i]) == 0) ops[i] = ok = 1;
  }
  free(copy);
  return ok;
}

/* Timed and warm-up calls for a message of `bytes` (the -i and -w options override them when > 0): about 256 MiB of
 * traffic per size, between 5 and 2000 calls, a tenth of that (at least 2) to warm up. */
static inline void bench_iters(size_t bytes, int iters_opt, int warm_opt, int *iters, int *warm) {
  int it = iters_opt > 0 ? iters_opt : (int)(256.0 * 1024 * 1024 / (double)bytes);
  if (iters_opt <= 0) it = it < 5 ? 5 : it > 2000 ? 2000 : it;
  *iters = it;
  *warm = warm_opt > 0 ? warm_opt : (it / 10 < 2 ? 2 : it / 10);
}

/* float32 elements for a message of `bytes`: S is per rank for allreduce, broadcast and sendrecv, the whole buffer
 * (a multiple of n elements) for the others; never zero. */
static inline size_t op_count(int op, size_t bytes, int n) {
  int whole = op == OP_ALLREDUCE || op == OP_BROADCAST || op == OP_SENDRECV;
  size_t count = bytes / 4;
  if (!whole) count = count / (size_t)n * (size_t)n;
  if (count == 0) count = whole ? 1 : (size_t)n;
  return count;
}

/* Small exact integers, so every sum is exact in float32 and the check needs no tolerance. */
static inline float bench_value(int rank, size_t i) { return (float)((rank + 1) + (int)(i % 7)); }

/* What the timed loops move before any check has run: never all-zero lines, which some hosts write much faster
 * (docs/benchmarks/README.md, "What the timed loops move"). */
static inline void fill_timed(float *sb, float *rb, size_t count, int rank) {
  for (size_t i = 0; i < count; i++) {
    sb[i] = bench_value(rank, i);
    rb[i] = -1.0f;
  }
}

/* Known inputs for one checked run of op (sendrecv is a ring shift: rank sends to rank + 1). */
static inline void fill_inputs(int op, float *sb, float *rb, size_t count, int n, int rank) {
  size_t per = count / (size_t)n;
  for (size_t i = 0; i < count; i++) sb[i] = bench_value(rank, i);
  if (op == OP_BROADCAST)
    for (size_t i = 0; i < count; i++) rb[i] = rank == 0 ? bench_value(0, i) : -1.0f;
  if (op == OP_ALLGATHER)
    for (size_t i = 0; i < per; i++) sb[i] = bench_value(rank, rank * per + i);
}

/* Elements of rb that differ from what op must have produced from fill_inputs. */
static inline long long count_wrong(int op, const float *rb, size_t count, int n, int rank) {
  size_t per = count / (size_t)n;
  long long wrong = 0;
  int tri = n * (n + 1) / 2;
  switch (op) {
    case OP_ALLREDUCE:
      for (size_t i = 0; i < count; i++) wrong += rb[i] != (float)(tri + n * (int)(i % 7));
      break;
    case OP_REDUCE_SCATTER:
      for (size_t i = 0; i < per; i++) wrong += rb[i] != (float)(tri + n * (int)((rank * per + i) % 7));
      break;
    case OP_ALLGATHER:
      for (size_t i = 0; i < per * (size_t)n; i++) wrong += rb[i] != bench_value((int)(i / per), i);
      break;
    case OP_ALLTOALL: /* block p of what we receive is block `rank` of p's input */
      for (size_t i = 0; i < per * (size_t)n; i++)
        wrong += rb[i] != bench_value((int)(i / per), rank * per + i % per);
      break;
    case OP_SENDRECV:
      for (size_t i = 0; i < count; i++) wrong += rb[i] != bench_value((rank + n - 1) % n, i);
      break;
    default:
      for (size_t i = 0; i < count; i++) wrong += rb[i] != bench_value(0, i);
      break;
  }
  return wrong;
}

/* CPUs this process may run on: the online ones, fewer where its affinity mask says so (needs _GNU_SOURCE). */
static inline long online_cores(void) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) < cores) cores = CPU_COUNT(&set);
  return cores;
}

/* Where ranks 0 and 1 run: the mean round trip of one cache line between their processes (rank 0 writes, rank 1
 * answers; up to `iters` times, as many as fit in 50 ms), in ns, on rank 0 (-1: rank 1 never answered within a
 * second); 0 on the other ranks, which return at once. On the development machine, a virtual one, it takes one of
 * two values that change from run to run (about 100 and 350 ns: the two virtual CPUs on one core complex of the
 * host or on two), and every transfer between the ranks gets faster or slower with it; the benches print it before
 * each operation so that runs can be compared placement by placement. `line`: 64 bytes both processes map, zero
 * before the first call. Rank 0 ends each call by writing -1 - (the value the next call starts from), which rank 1
 * reads to stay in step. */
static inline double pingpong_seconds(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

static inline double pingpong_ns(long *line, int rank, int iters) {
  static long base = 0; /* what the line held at the start of this call: answers so far, twice */
  if (rank > 1) return 0;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  if (rank == 1) {
    for (unsigned spins = 1;; spins++) {
      long v = __atomic_load_n(line, __ATOMIC_ACQUIRE);
      if (v < 0 && -1 - v > base) { /* rank 0's end of this call (the last call's end equals base) */
        base = -1 - v;
        return 0;
      }
      if (v > 0 && v >= base && (v - base) % 2 == 1) {
        __atomic_store_n(line, v + 1, __ATOMIC_RELEASE);
        spins = 0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
      }
      if ((spins & 0xfffffu) == 0 && spins != 0 && pingpong_seconds(&t0) > 2.0) return 0;
    }
  }
  long done = 0;
  int ok = 1;
  while (done < iters && ok && (done % 256 != 0 || pingpong_seconds(&t0) < 0.05)) {
    long ask = base + 2 * done + 1;
    __atomic_store_n(line, ask, __ATOMIC_RELEASE);
    for (unsigned spins = 1; __atomic_load_n(line, __ATOMIC_ACQUIRE) != ask + 1; spins++)
      if ((spins & 0xfffffu) == 0 && pingpong_seconds(&t0) > 1.0) {
        ok = 0;
        break;
      }
    done += ok;
  }
  double took = pingpong_seconds(&t0);
  base += 2 * done + 2; /* past the last ask, answered or not */
  __atomic_store_n(line, -1 - base, __ATOMIC_RELEASE);
  return done > 0 ? took / (double)done * 1e9 : -1;
}

/* nccl-tests: busbw = algbw * factor. */
static inline double bus_factor(int op, int n) {
  switch (op) {
    case OP_ALLREDUCE: return 2.0 * (n - 1) / n;
    case OP_BROADCAST: case OP_SENDRECV: return 1.0;
    default: return (double)(n - 1) / n;
  }
}

#endif /* T3D_BENCH_COMMON_H */
