/* mpi_bench_c.c: the peer of t3d_bench_c at the C level: the same operations, sizes, iteration counts, timing
 * (slowest rank's mean of a tight issue-and-complete loop after a barrier) and check, through MPI's C API, so that
 * t3d and Open MPI compare with neither paying Python's or torch's dispatch. Built when CMake finds MPI; run with
 *   mpirun --oversubscribe --bind-to none -np 2 <build>/bench/c/mpi_bench_c [-b 8] [-e 4K] [-o allreduce,...]
 * (add OMPI_MCA_btl=self,vader to keep Open MPI on shared memory, as t3d-bench does). */
#include <mpi.h>

#include "bench_common.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  size_t minb, maxb;
  int factor;
  int ops[OP_COUNT];
  int check;
  int warmup, iters; /* 0: by size, as t3d_bench_c */
} opts_t;

static void usage(const char *argv0, int rank) {
  if (rank == 0) {
    fprintf(stderr,
            "usage: mpirun -np N %s [-b minbytes] [-e maxbytes] [-f factor] [-o op[,op...]] [-w warmup] [-i iters]\n"
            "          [-c 0|1]\n"
            "  ops: ",
            argv0);
    print_op_names(stderr);
    fprintf(stderr,
            " (ring shift) (default: all);\n"
            "  float32, sum;\n"
            "  sizes as in t3d_bench_c (total bytes, K/M/G suffixes; default 8 B .. 256 MiB x2)\n");
  }
  MPI_Finalize();
  exit(2);
}

static int run_once(int op, float *sb, float *rb, size_t count, int n) {
  int per = (int)(count / (size_t)n);
  switch (op) {
    case OP_ALLREDUCE: return MPI_Allreduce(sb, rb, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    case OP_ALLGATHER: return MPI_Allgather(sb, per, MPI_FLOAT, rb, per, MPI_FLOAT, MPI_COMM_WORLD);
    case OP_REDUCE_SCATTER: return MPI_Reduce_scatter_block(sb, rb, per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    case OP_ALLTOALL: return MPI_Alltoall(sb, per, MPI_FLOAT, rb, per, MPI_FLOAT, MPI_COMM_WORLD);
    case OP_SENDRECV: {
      int rank;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      return MPI_Sendrecv(sb, (int)count, MPI_FLOAT, (rank + 1) % n, 0, rb, (int)count, MPI_FLOAT, (rank + n - 1) % n,
                          0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    default: return MPI_Bcast(rb, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
  }
}

static long long check(int op, float *sb, float *rb, size_t count, int n, int rank) {
  fill_inputs(op, sb, rb, count, n, rank);
  if (run_once(op, sb, rb, count, n) != MPI_SUCCESS) return -1;
  return count_wrong(op, rb, count, n, rank);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  opts_t o = {.minb = 8, .maxb = 256u << 20, .factor = 2, .check = 1};
  for (int i = 0; i < OP_COUNT; i++) o.ops[i] = 1;
  int c;
  while ((c = getopt(argc, argv, "b:e:f:o:w:i:c:h")) != -1) {
    switch (c) {
      case 'b': o.minb = parse_size(optarg); break;
      case 'e': o.maxb = parse_size(optarg); break;
      case 'f': o.factor = atoi(optarg); break;
      case 'w': o.warmup = atoi(optarg); break;
      case 'i': o.iters = atoi(optarg); break;
      case 'c': o.check = atoi(optarg); break;
      case 'o':
        if (!parse_ops(optarg, o.ops)) usage(argv[0], rank);
        break;
      default: usage(argv[0], rank);
    }
  }
  if (o.factor < 2 || o.minb < 1 || o.maxb < o.minb || o.maxb / 4 > (size_t)2147483647) usage(argv[0], rank);
  if (rank == 0) {
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(lib, &len);
    char *nl = strchr(lib, '\n');
    if (nl != NULL) *nl = '\0';
    printf("# mpi_bench_c: %d ranks, %s\n", n, lib);
  }
  /* The cache line for pingpong_ns: in a shared window, where all ranks share one node and have a core each. */
  long *line = NULL;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Win win = MPI_WIN_NULL;
  int node_n = 0;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  MPI_Comm_size(node, &node_n);
  if (n >= 2 && node_n == n && n <= online_cores()) {
    long *mine = NULL;
    MPI_Aint sz = 0;
    int du = 0;
    if (MPI_Win_allocate_shared(rank == 0 ? 64 : 0, 1, MPI_INFO_NULL, node, &mine, &win) == MPI_SUCCESS &&
        MPI_Win_shared_query(win, 0, &sz, &du, &line) == MPI_SUCCESS && sz >= 64) {
      if (rank == 0) *line = 0;
    } else {
      line = NULL;
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  size_t maxcount = o.maxb / 4 + 1;
  float *sb = NULL, *rb = NULL;
  if (posix_memalign((void **)&sb, 4096, maxcount * 4) != 0 || posix_memalign((void **)&rb, 4096, maxcount * 4) != 0) {
    fprintf(stderr, "rank %d: out of memory for %zu-byte buffers\n", rank, maxcount * 4);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  fill_timed(sb, rb, maxcount, rank);
  int rc = 0;
  long long wrong_total = 0;
  for (int op = 0; op < OP_COUNT && rc == 0; op++) {
    if (!o.ops[op]) continue;
    double rt = line != NULL ? pingpong_ns(line, rank, 20000) : 0;
    if (rank == 0) {
      printf("\n# %s, %d ranks, float32%s; time = slowest rank's mean per call\n", op_names[op], n,
             op_reduces(op) ? " sum" : "");
      if (line != NULL) printf("# placement: a cache line's round trip between ranks 0 and 1 takes %.0f ns\n", rt);
      printf("# %12s %12s %6s %5s | %-4s %10s %8s %8s %6s\n", "size(B)", "count", "type", "redop", "mpi", "time(us)",
             "algbw", "busbw", "#wrong");
      fflush(stdout);
    }
    for (size_t bytes = o.minb; bytes <= o.maxb; bytes = bytes * (size_t)o.factor) {
      size_t count = op_count(op, bytes, n);
      size_t real = count * 4;
      int iters, warm;
      bench_iters(real, o.iters, o.warmup, &iters, &warm);
      for (int i = 0; i < warm && rc == 0; i++) rc = run_once(op, sb, rb, count, n);
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      for (int i = 0; i < iters && rc == 0; i++) rc = run_once(op, sb, rb, count, n);
      double mine = (MPI_Wtime() - t0) / iters, slowest = 0;
      long long wrong = o.check && rc == 0 ? check(op, sb, rb, count, n, rank) : 0, wrong_all = 0;
      if (wrong < 0) wrong = 1000000000LL;
      if (rc != MPI_SUCCESS) {
        fprintf(stderr, "rank %d: %s of %zu bytes failed (MPI error %d)\n", rank, op_names[op], real, rc);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
      MPI_Reduce(&wrong, &wrong_all, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
      wrong_total += wrong_all;
      if (rank == 0) {
        double algbw = (double)real / slowest / 1e9;
        printf("  %12zu %12zu %6s %5s | %-4s %10.3f %8.3f %8.3f %6lld\n", real, count, "float",
               op_reduces(op) ? "sum" : "-", "mpi", slowest * 1e6, algbw,
               algbw * bus_factor(op, n), wrong_all);
        fflush(stdout);
      }
    }
  }
  free(sb);
  free(rb);
  if (win != MPI_WIN_NULL) MPI_Win_free(&win);
  MPI_Comm_free(&node);
  MPI_Finalize();
  if (wrong_total > 0) {
    fprintf(stderr, "mpi_bench_c: %lld wrong elements (see the #wrong columns)\n", wrong_total);
    return 1;
  }
  return rc == 0 ? 0 : 1;
}
