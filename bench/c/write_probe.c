/* write_probe: what the bytes written cost on this host. One thread per core writes the same 128 KiB source
 * again and again into its own destination buffers (libt3d's copy with non-temporal stores, as the collectives'
 * large copies), all threads at once, the source holding one of three patterns in turn:
 *   zero   all-zero bytes (what a timed loop on torch.zeros moves)
 *   -0.0   float -0.0 in every element (0x80000000: what t3d-bench's all_reduce rows move)
 *   data   the C benches' inputs (small integers as float32)
 * and prints each pattern's write bandwidth (bytes written by all threads / time), best and median of its rounds.
 * On the development machine all-zero lines were written 1.5-4x faster than the others: a benchmark whose
 * timed data is zero measures that, not the transport (docs/benchmarks/README.md, "What the timed loops move").
 *
 *   write_probe [-s MiB per destination buffer (32)] [-d destination buffers per thread (7)] [-r rounds (7)]
 *               [-t threads (the CPUs this process may run on)] */
#include <t3d.h>

#include <pthread.h>
#include <stdint.h>

#include "bench_common.h"

#define PIECE (128u * 1024u)
#define PATTERNS 3
static const char *const pattern_names[PATTERNS] = {"zero", "-0.0", "data"};

typedef struct {
  pthread_barrier_t *start, *end;
  size_t bytes;
  int dests, rounds;
  char *src[PATTERNS];
  char **dst;
} worker_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void fill(char *src, int pattern) {
  float *f = (float *)(void *)src;
  for (size_t i = 0; i < PIECE / sizeof(float); i++) f[i] = pattern == 0 ? 0.0f : pattern == 1 ? -0.0f : bench_value(0, i);
}

static int out_of_memory(void) {
  fprintf(stderr, "write_probe: out of memory\n");
  return 1;
}

/* Every round: each pattern once (the order turns with the round), every thread between the same two barriers. */
static void *work(void *arg) {
  worker_t *w = arg;
  for (int r = 0; r < w->rounds; r++) {
    for (int k = 0; k < PATTERNS; k++) {
      const char *src = w->src[(r + k) % PATTERNS];
      pthread_barrier_wait(w->start);
      for (size_t at = 0; at < w->bytes; at += PIECE)
        for (int d = 0; d < w->dests; d++) t3d_copy_stream(w->dst[d] + at, src, PIECE);
      pthread_barrier_wait(w->end);
    }
  }
  return NULL;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static int usage(const char *argv0) {
  fprintf(stderr, "usage: %s [-s MiB] [-d dests] [-r rounds] [-t threads]\n", argv0);
  return 2;
}

int main(int argc, char **argv) {
  size_t mib = 32;
  int dests = 7, rounds = 7, threads = 0, c;
  while ((c = getopt(argc, argv, "s:d:r:t:")) != -1) {
    switch (c) {
      case 's': mib = (size_t)strtoul(optarg, NULL, 10); break;
      case 'd': dests = atoi(optarg); break;
      case 'r': rounds = atoi(optarg); break;
      case 't': threads = atoi(optarg); break;
      default: return usage(argv[0]);
    }
  }
  if (threads <= 0) threads = (int)online_cores();
  if (threads <= 0) threads = 1;
  if (mib == 0 || dests <= 0 || rounds <= 0 || threads > 256) return usage(argv[0]);
  size_t bytes = mib << 20;
  pthread_barrier_t start, end;
  pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
  pthread_barrier_init(&end, NULL, (unsigned)threads + 1);
  worker_t *w = calloc((size_t)threads, sizeof *w);
  pthread_t *tid = calloc((size_t)threads, sizeof *tid);
  double *times = calloc((size_t)PATTERNS * (size_t)rounds, sizeof *times);
  if (w == NULL || tid == NULL || times == NULL) return out_of_memory();
  for (int t = 0; t < threads; t++) {
    w[t] = (worker_t){&start, &end, bytes, dests, rounds, {NULL}, calloc((size_t)dests, sizeof(char *))};
    if (w[t].dst == NULL) return out_of_memory();
    for (int k = 0; k < PATTERNS; k++) {
      if (posix_memalign((void **)&w[t].src[k], 4096, PIECE) != 0) return out_of_memory();
      fill(w[t].src[k], k);
    }
    for (int d = 0; d < dests; d++) {
      if (posix_memalign((void **)&w[t].dst[d], 4096, bytes) != 0) return out_of_memory();
      memset(w[t].dst[d], 0x5a, bytes); /* touched, and neither pattern */
    }
    pthread_create(&tid[t], NULL, work, &w[t]);
  }
  for (int r = 0; r < rounds; r++) {
    for (int k = 0; k < PATTERNS; k++) {
      pthread_barrier_wait(&start);
      double t0 = now_s();
      pthread_barrier_wait(&end);
      times[((r + k) % PATTERNS) * rounds + r] = now_s() - t0;
    }
  }
  for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
  double written = (double)bytes * dests * threads;
  printf("# write_probe: %d thread(s), each writing a 128 KiB source into %d buffers of %zu MiB with non-temporal "
         "stores; %d rounds, patterns taking turns\n", threads, dests, mib, rounds);
  printf("# %-6s %12s %12s\n", "bytes", "best GB/s", "median GB/s");
  for (int k = 0; k < PATTERNS; k++) {
    double *tk = times + k * rounds;
    qsort(tk, (size_t)rounds, sizeof *tk, cmp_double);
    printf("  %-6s %12.1f %12.1f\n", pattern_names[k], written / tk[0] * 1e-9, written / tk[rounds / 2] * 1e-9);
  }
  for (int t = 0; t < threads; t++) {
    for (int k = 0; k < PATTERNS; k++) free(w[t].src[k]);
    for (int d = 0; d < dests; d++) free(w[t].dst[d]);
    free(w[t].dst);
  }
  free(w);
  free(tid);
  free(times);
  pthread_barrier_destroy(&start);
  pthread_barrier_destroy(&end);
  return 0;
}
