/* t3d_bench_c.c: collective benchmark of the C library, no torch. Forks N ranks as processes that meet through a
 * small file store, times allreduce / allgather / reduce_scatter / alltoall / broadcast over a range of float32
 * sizes and prints nccl-tests style columns (size, count, type, redop, time, algbw, busbw, #wrong), for the default
 * transport (shared memory on one host) and/or UCX only, side by side. */
#include "t3d.h"

#include "bench_common.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---------- file store: one file per key, written to a temporary name and renamed into place ---------- */

typedef struct {
  char dir[256];
} fstore_t;

static void key_path(const fstore_t *fs, const char *key, char *out, size_t len) {
  size_t at = (size_t)snprintf(out, len, "%s/", fs->dir);
  for (const char *c = key; *c && at + 4 < len; c++) {
    unsigned char u = (unsigned char)*c;
    if ((u >= 'a' && u <= 'z') || (u >= 'A' && u <= 'Z') || (u >= '0' && u <= '9') || u == '-' || u == '_') {
      out[at++] = (char)u;
    } else {
      at += (size_t)snprintf(out + at, len - at, "%%%02x", u);
    }
  }
  out[at] = '\0';
}

static t3d_result_t fs_set(void *ctx, const char *key, const void *value, size_t len) {
  fstore_t *fs = ctx;
  char path[1024], tmp[1100];
  key_path(fs, key, path, sizeof path);
  static unsigned counter;
  snprintf(tmp, sizeof tmp, "%s/.tmp-%d-%u", fs->dir, (int)getpid(), counter++);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) return T3D_ERR_SYSTEM;
  const char *p = value;
  while (len > 0) {
    ssize_t w = write(fd, p, len);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      close(fd);
      return T3D_ERR_SYSTEM;
    }
    p += w;
    len -= (size_t)w;
  }
  close(fd);
  return rename(tmp, path) == 0 ? T3D_OK : T3D_ERR_SYSTEM;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static t3d_result_t fs_get(void *ctx, const char *key, void **value, size_t *len, int64_t timeout_ms) {
  fstore_t *fs = ctx;
  char path[1024];
  key_path(fs, key, path, sizeof path);
  double until = now_s() + (double)timeout_ms / 1000.0;
  for (;;) {
    int fd = open(path, O_RDONLY);
    if (fd >= 0) {
      struct stat st;
      if (fstat(fd, &st) != 0) {
        close(fd);
        return T3D_ERR_SYSTEM;
      }
      size_t n = (size_t)st.st_size, got = 0;
      char *buf = malloc(n + 1);
      if (buf == NULL) {
        close(fd);
        return T3D_ERR_NO_MEMORY;
      }
      while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
      }
      close(fd);
      *value = buf;
      *len = got;
      return T3D_OK;
    }
    if (timeout_ms >= 0 && now_s() > until) return T3D_ERR_TIMEOUT;
    struct timespec ts = {0, 200000};
    nanosleep(&ts, NULL);
  }
}

static void fs_remove(const fstore_t *fs) {
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", fs->dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", fs->dir);
}

/* ---------- options ---------- */

typedef struct {
  int nranks;
  size_t minb, maxb;
  int factor;
  int ops[OP_COUNT];
  int transports; /* bit 0: auto, bit 1: ucx */
  int check;
  int warmup, iters; /* 0: by size */
  int async;         /* -a: collectives without T3D_FLAG_BLOCKING */
  int registered;    /* -R: buffers from t3d_mem_alloc (registered memory) */
  int grouped;       /* -G: sendrecv as a group of t3d_send and t3d_recv */
} opts_t;

/* What every collective call passes: T3D_FLAG_BLOCKING (each call is waited for at once, as MPI_Allreduce and the
 * other blocking calls that mpi_bench_c times), unless -a. */
static t3d_opts_t call_opts;
/* -G: the ring shift as a group of t3d_send and t3d_recv, waited on (torch's batch_isend_irecv), instead of
 * t3d_sendrecv (the blocking exchange, as MPI_Sendrecv that mpi_bench_c times). */
static int sendrecv_grouped;

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [-n ranks] [-b minbytes] [-e maxbytes] [-f factor] [-o op[,op...]] [-t auto|ucx|both]\n"
          "          [-w warmup] [-i iters] [-c 0|1] [-a] [-R] [-G]\n"
          "  ops: ",
          argv0);
  print_op_names(stderr);
  fprintf(stderr,
          " (default: all)\n"
          "  -R takes the buffers from t3d_mem_alloc (registered memory: large collectives then copy in place)\n"
          "  -a issues collectives without T3D_FLAG_BLOCKING (the progress thread runs those too large to start on\n"
          "     the calling thread), still waiting for each at once\n"
          "  sendrecv is a ring shift: every rank sends to rank + 1 and receives from rank - 1 in one blocking\n"
          "     t3d_sendrecv (as MPI_Sendrecv); -G: in one group of t3d_send and t3d_recv, waited on\n"
          "  sizes are total bytes as in nccl-tests (K/M/G suffixes); float32, sum; default 8 B .. 256 MiB x2\n"
          "  -t both runs every size on two communicators: the default transport (shared memory on one host) and\n"
          "     T3D_TRANSPORT=ucx; iterations default to about 256 MiB of traffic per size (5 .. 2000)\n");
  exit(2);
}

/* ---------- one rank ---------- */

typedef struct {
  double *times;        /* shared: per rank, mean seconds of the last measurement */
  long long *wrong;     /* shared: per rank, wrong elements of the last check */
  long *line;           /* shared: the cache line ranks 0 and 1 ping-pong (pingpong_ns) */
  int placement;        /* measure it: 2 or more ranks, no more than the cores */
} shared_t;

static int fail(int rank, const char *what, t3d_comm_t *c, t3d_result_t r) {
  fprintf(stderr, "rank %d: %s -> %s: %s\n", rank, what, t3d_result_string(r),
          c ? t3d_comm_last_error(c) : t3d_thread_last_error());
  return 1;
}

/* Ring shift: one t3d_sendrecv, or (-G) as the torch bench's send_recv (batch_isend_irecv): both in one group,
 * waited on together. */
static t3d_result_t sendrecv(t3d_comm_t *c, float *sb, float *rb, size_t count, int n) {
  int rank = t3d_comm_rank(c);
  if (!sendrecv_grouped) {
    return t3d_sendrecv(c, sb, count, (rank + 1) % n, rb, count, (rank + n - 1) % n, T3D_FLOAT32, 0, NULL, NULL);
  }
  t3d_request_t *s = NULL, *r = NULL, *group = NULL;
  t3d_result_t res = t3d_group_start(c);
  if (res != T3D_OK) return res;
  res = t3d_send(c, sb, count, T3D_FLOAT32, (rank + 1) % n, 0, NULL, &s);
  if (res == T3D_OK) res = t3d_recv(c, rb, count, T3D_FLOAT32, (rank + n - 1) % n, 0, NULL, &r);
  t3d_result_t end = t3d_group_end(c, &group);
  if (res == T3D_OK) res = end;
  if (res == T3D_OK) res = t3d_wait(group, -1);
  t3d_request_free(group);
  t3d_request_free(s);
  t3d_request_free(r);
  return res;
}

static t3d_result_t run_once(t3d_comm_t *c, int op, float *sb, float *rb, size_t count, int n) {
  t3d_request_t *req = NULL;
  t3d_result_t r;
  if (op == OP_SENDRECV) return sendrecv(c, sb, rb, count, n);
  switch (op) {
    case OP_ALLREDUCE: r = t3d_allreduce(c, sb, rb, count, T3D_FLOAT32, T3D_SUM, &call_opts, &req); break;
    case OP_ALLGATHER: r = t3d_allgather(c, sb, rb, count / (size_t)n, T3D_FLOAT32, &call_opts, &req); break;
    case OP_REDUCE_SCATTER:
      r = t3d_reduce_scatter(c, sb, rb, count / (size_t)n, T3D_FLOAT32, T3D_SUM, &call_opts, &req);
      break;
    case OP_ALLTOALL: r = t3d_alltoall(c, sb, rb, count / (size_t)n, T3D_FLOAT32, &call_opts, &req); break;
    default: r = t3d_broadcast(c, rb, count, T3D_FLOAT32, 0, &call_opts, &req); break;
  }
  if (r != T3D_OK) return r;
  r = t3d_wait(req, -1);
  t3d_request_free(req);
  return r;
}

static t3d_result_t barrier(t3d_comm_t *c) {
  t3d_request_t *req = NULL;
  t3d_result_t r = t3d_barrier(c, NULL, &req);
  if (r != T3D_OK) return r;
  r = t3d_wait(req, -1);
  t3d_request_free(req);
  return r;
}

static long long check(t3d_comm_t *c, int op, float *sb, float *rb, size_t count, int n, int rank) {
  fill_inputs(op, sb, rb, count, n, rank);
  if (run_once(c, op, sb, rb, count, n) != T3D_OK) return -1;
  return count_wrong(op, rb, count, n, rank);
}

static int rank_main(const opts_t *o, int rank, const fstore_t *fs, shared_t *sh) {
  t3d_store_t store = {(void *)fs, fs_set, fs_get};
  t3d_comm_t *comms[2] = {NULL, NULL};
  const char *tnames[2] = {"auto", "ucx"};
  for (int t = 0; t < 2; t++) {
    if (!(o->transports & (1 << t))) continue;
    t3d_config_t cfg;
    t3d_config_init(&cfg);
    cfg.name = tnames[t];
    cfg.key_prefix = tnames[t];
    cfg.transport = t == 1 ? "ucx" : NULL;
    cfg.timeout_ms = 600000;
    t3d_result_t r = t3d_comm_init(&comms[t], rank, o->nranks, &store, &cfg);
    if (r != T3D_OK) return fail(rank, "t3d_comm_init", NULL, r);
  }
  size_t maxcount = o->maxb / 4 + 1;
  float *sb = NULL, *rb = NULL;
  if (o->registered) {
    t3d_result_t r = t3d_mem_alloc(maxcount * 4, (void **)&sb);
    if (r == T3D_OK) r = t3d_mem_alloc(maxcount * 4, (void **)&rb);
    if (r != T3D_OK) return fail(rank, "t3d_mem_alloc", NULL, r);
  } else if (posix_memalign((void **)&sb, 4096, maxcount * 4) != 0 ||
             posix_memalign((void **)&rb, 4096, maxcount * 4) != 0) {
    return fail(rank, "out of memory for buffers", NULL, T3D_ERR_NO_MEMORY);
  }
  fill_timed(sb, rb, maxcount, rank);
  int n = o->nranks;
  long long wrong_total = 0;
  for (int op = 0; op < OP_COUNT; op++) {
    if (!o->ops[op]) continue;
    double rt = sh->placement ? pingpong_ns(sh->line, rank, 20000) : 0;
    if (rank == 0) {
      printf("\n# %s, %d ranks, float32%s; time = slowest rank's mean per call (issue + wait%s)\n", op_names[op], n,
             op_reduces(op) ? " sum" : "",
             op == OP_SENDRECV ? "" : o->async ? "; non-blocking" : "; T3D_FLAG_BLOCKING");
      if (sh->placement) printf("# placement: a cache line's round trip between ranks 0 and 1 takes %.0f ns\n", rt);
      printf("# %12s %12s %6s %5s", "size(B)", "count", "type", "redop");
      for (int t = 0; t < 2; t++)
        if (o->transports & (1 << t))
          printf(" | %-4s %10s %8s %8s %6s", t == 0 ? "auto" : "ucx", "time(us)", "algbw", "busbw", "#wrong");
      printf("\n");
      fflush(stdout);
    }
    for (size_t bytes = o->minb; bytes <= o->maxb; bytes = bytes * (size_t)o->factor) {
      size_t count = op_count(op, bytes, n);
      size_t real = count * 4;
      int iters, warm;
      bench_iters(real, o->iters, o->warmup, &iters, &warm);
      double tm[2] = {0, 0};
      long long wr[2] = {0, 0};
      for (int t = 0; t < 2; t++) {
        t3d_comm_t *c = comms[t];
        if (c == NULL) continue;
        for (int i = 0; i < warm; i++)
          if (run_once(c, op, sb, rb, count, n) != T3D_OK) return fail(rank, op_names[op], c, T3D_ERR_INTERNAL);
        if (barrier(c) != T3D_OK) return fail(rank, "barrier", c, T3D_ERR_INTERNAL);
        double t0 = now_s();
        for (int i = 0; i < iters; i++) {
          t3d_result_t r = run_once(c, op, sb, rb, count, n);
          if (r != T3D_OK) return fail(rank, op_names[op], c, r);
        }
        sh->times[rank] = (now_s() - t0) / iters;
        sh->wrong[rank] = o->check ? check(c, op, sb, rb, count, n, rank) : 0;
        if (barrier(c) != T3D_OK) return fail(rank, "barrier", c, T3D_ERR_INTERNAL);
        for (int p = 0; p < n; p++) {
          if (sh->times[p] > tm[t]) tm[t] = sh->times[p];
          wr[t] += sh->wrong[p] < 0 ? 1000000000LL : sh->wrong[p];
        }
        wrong_total += wr[t];
        /* Nobody writes the shared slots again before rank 0 has read them: the next measurement needs it. */
        if (barrier(c) != T3D_OK) return fail(rank, "barrier", c, T3D_ERR_INTERNAL);
      }
      if (rank == 0) {
        printf("  %12zu %12zu %6s %5s", real, count, "float", op_reduces(op) ? "sum" : "-");
        for (int t = 0; t < 2; t++) {
          if (comms[t] == NULL) continue;
          double algbw = (double)real / tm[t] / 1e9;
          printf(" | %-4s %10.3f %8.3f %8.3f %6lld", t == 0 ? "auto" : "ucx", tm[t] * 1e6, algbw,
                 algbw * bus_factor(op, n), wr[t]);
        }
        printf("\n");
        fflush(stdout);
      }
    }
  }
  for (int t = 0; t < 2; t++)
    if (comms[t] != NULL) t3d_comm_destroy(comms[t]);
  if (o->registered) {
    t3d_mem_free(sb);
    t3d_mem_free(rb);
  } else {
    free(sb);
    free(rb);
  }
  if (rank == 0 && wrong_total > 0) {
    fprintf(stderr, "t3d_bench_c: %lld wrong elements (see the #wrong columns)\n", wrong_total);
    return 1; /* rank 0 alone: one report */
  }
  return 0;
}

/* One process copying a 64 MiB buffer: the machine's memory-copy bandwidth, the physical reference. */
static void print_memcpy_reference(void) {
  size_t n = 64u << 20;
  char *a = malloc(n), *b = malloc(n);
  if (a == NULL || b == NULL) return;
  memset(a, 1, n);
  memset(b, 2, n);
  double best = 1e9;
  for (int i = 0; i < 5; i++) {
    double t0 = now_s();
    memcpy(b, a, n);
    double dt = now_s() - t0;
    if (dt < best) best = dt;
  }
  printf("# memcpy reference (one process, 64 MiB): %.2f GB/s one-way\n", (double)n / best / 1e9);
  free(a);
  free(b);
}

/* With more ranks than cores, a collective that needs every rank's input finishes a call only after every rank has
 * run since the last one: n processes on c cores, each giving up its core once per call, are what that alone costs.
 * n processes call sched_yield() in a loop, started together; the slowest one's time per call is the floor. */
static void print_switch_floor(int n) {
  long cores = online_cores();
  if (cores <= 0 || n <= cores) return;
  const int iters = 20000;
  const size_t bytes = (size_t)n * sizeof(double) + 64; /* each child's time, then the start flag */
  double *took = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (took == MAP_FAILED) return;
  volatile int *go = (volatile int *)(took + n);
  *go = 0;
  pid_t *pids = calloc((size_t)n, sizeof(pid_t));
  int started = 0;
  for (int r = 0; r < n && pids != NULL; r++, started++) {
    pids[r] = fork();
    if (pids[r] < 0) break;
    if (pids[r] == 0) {
      while (!__atomic_load_n(go, __ATOMIC_ACQUIRE)) sched_yield();
      double t0 = now_s();
      for (int i = 0; i < iters; i++) sched_yield();
      took[r] = (now_s() - t0) / iters;
      _exit(0);
    }
  }
  __atomic_store_n(go, 1, __ATOMIC_RELEASE);
  double worst = 0;
  int ok = pids != NULL && started == n;
  for (int r = 0; r < started; r++) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    if (took[r] > worst) worst = took[r];
  }
  if (ok) {
    printf("# switch floor (%d processes on %ld cores, each calling sched_yield() once per call, nothing else): "
           "%.2f us per call\n", n, cores, worst * 1e6);
  }
  free(pids);
  munmap(took, bytes);
}

int main(int argc, char **argv) {
  opts_t o = {.nranks = 2, .minb = 8, .maxb = 256u << 20, .factor = 2, .transports = 3, .check = 1};
  for (int i = 0; i < OP_COUNT; i++) o.ops[i] = 1;
  int c;
  while ((c = getopt(argc, argv, "n:b:e:f:o:t:w:i:c:aRGh")) != -1) {
    switch (c) {
      case 'n': o.nranks = atoi(optarg); break;
      case 'b': o.minb = parse_size(optarg); break;
      case 'e': o.maxb = parse_size(optarg); break;
      case 'f': o.factor = atoi(optarg); break;
      case 'w': o.warmup = atoi(optarg); break;
      case 'i': o.iters = atoi(optarg); break;
      case 'c': o.check = atoi(optarg); break;
      case 'a': o.async = 1; break;
      case 'R': o.registered = 1; break;
      case 'G': o.grouped = 1; break;
      case 't':
        if (strcmp(optarg, "auto") == 0) o.transports = 1;
        else if (strcmp(optarg, "ucx") == 0) o.transports = 2;
        else if (strcmp(optarg, "both") == 0) o.transports = 3;
        else usage(argv[0]);
        break;
      case 'o':
        if (!parse_ops(optarg, o.ops)) usage(argv[0]);
        break;
      default: usage(argv[0]);
    }
  }
  if (o.nranks < 1 || o.factor < 2 || o.minb < 1 || o.maxb < o.minb) usage(argv[0]);
  call_opts.flags = o.async ? 0u : T3D_FLAG_BLOCKING;
  sendrecv_grouped = o.grouped;
  printf("# t3d_bench_c: %d ranks (processes), t3d %s, %s\n", o.nranks, t3d_version_string(),
         t3d_ucx_version_string());
  print_memcpy_reference();
  print_switch_floor(o.nranks);
  fflush(stdout);

  fstore_t fs;
  snprintf(fs.dir, sizeof fs.dir, "/tmp/t3d-bench-%d", (int)getpid());
  if (mkdir(fs.dir, 0700) != 0) {
    perror("mkdir");
    return 1;
  }
  shared_t sh;
  size_t line_at = ((size_t)o.nranks * (sizeof(double) + sizeof(long long)) + 63) / 64 * 64;
  void *mem = mmap(NULL, line_at + 64, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 1;
  sh.times = mem;
  sh.wrong = (long long *)(sh.times + o.nranks);
  sh.line = (long *)((char *)mem + line_at);
  sh.placement = o.nranks >= 2 && o.nranks <= online_cores();
  pid_t *pids = calloc((size_t)o.nranks, sizeof(pid_t));
  for (int r = 0; r < o.nranks; r++) {
    pids[r] = fork();
    if (pids[r] == 0) _exit(rank_main(&o, r, &fs, &sh));
    if (pids[r] < 0) {
      perror("fork");
      return 1;
    }
  }
  int rc = 0;
  for (int r = 0; r < o.nranks; r++) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "rank %d failed (status 0x%x)\n", r, st);
      rc = 1;
    }
  }
  fs_remove(&fs);
  free(pids);
  return rc;
}
