#!/usr/bin/env bash
# The C-level benchmark files of docs/benchmarks/: t3d_bench_c (the C library alone, no torch) and, right after it,
# Open MPI's C API in the same loop (mpi_bench_c, built when CMake found MPI: ./scripts/install-mpi-peer.sh once,
# then the build). Usage: scripts/bench-c.sh N [MAX]   e.g. scripts/bench-c.sh 2; scripts/bench-c.sh 8 16M
# Writes docs/benchmarks/collectives-c-Nranks.txt and collectives-c-mpi-Nranks.txt (T3D_BENCH_OUT: another folder).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
N="${1:?usage: scripts/bench-c.sh N [MAX]}"
MAX="${2:-}"
OUT="${T3D_BENCH_OUT:-docs/benchmarks}"
T3D=build/bench/c/t3d_bench_c
MPI=build/bench/c/mpi_bench_c
[ -x "$T3D" ] || { echo "bench-c: $T3D is not built (scripts/setup.sh builds it)" >&2; exit 2; }
[ -x "$MPI" ] || { echo "bench-c: $MPI is not built: ./scripts/install-mpi-peer.sh, then scripts/setup.sh" >&2; exit 2; }
COLL=allreduce,allgather,reduce_scatter,alltoall,broadcast
RANGE=()
[ -n "$MAX" ] && RANGE=(-e "$MAX")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader
MPIRUN=(mpirun --oversubscribe --bind-to none -np "$N")
stamp() { date -u '+%Y-%m-%d %H:%M:%S UTC'; }
# The CPU each run had: this virtual machine has run on different hosts (an Intel Xeon with AVX-512, an AMD EPYC).
cpu() { sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1; }
load() { cut -d' ' -f1 /proc/loadavg; }

t3d_coll="$(mktemp)"; t3d_p2p="$(mktemp)"; mpi_coll="$(mktemp)"; mpi_p2p="$(mktemp)"
trap 'rm -f "$t3d_coll" "$t3d_p2p" "$mpi_coll" "$mpi_p2p"' EXIT
# Each pair runs back to back, t3d first, so that both see the same spell of this shared machine.
h1="# command: $T3D -n $N -t auto ${RANGE[*]} -o $COLL  ($(stamp), load $(load), $(cpu); blocking calls, as Open MPI's bench times them; the sendrecv section below is from its own run)"
"$T3D" -n "$N" -t auto "${RANGE[@]}" -o "$COLL" > "$t3d_coll"
m1="# command: OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader ${MPIRUN[*]} $MPI ${RANGE[*]} -o $COLL  ($(stamp), load $(load); right after the t3d run)"
"${MPIRUN[@]}" "$MPI" "${RANGE[@]}" -o "$COLL" > "$mpi_coll"
h2="# command: $T3D -n $N -t both ${RANGE[*]} -o sendrecv  ($(stamp), load $(load); point-to-point over shared-memory rings, \"auto\", and over UCX, \"ucx\")"
"$T3D" -n "$N" -t both "${RANGE[@]}" -o sendrecv > "$t3d_p2p"
m2="# command: OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader ${MPIRUN[*]} $MPI ${RANGE[*]} -o sendrecv  ($(stamp), right after the t3d run)"
"${MPIRUN[@]}" "$MPI" "${RANGE[@]}" -o sendrecv > "$mpi_p2p"

mkdir -p "$OUT"
{ echo "$h1"; echo "$h2"; cat "$t3d_coll" "$t3d_p2p"; } > "$OUT/collectives-c-${N}ranks.txt"
# mpi_bench_c prints its own header once per run; keep the first.
{ echo "$m1"; echo "$m2"; cat "$mpi_coll"; grep -v '^# mpi_bench_c:' "$mpi_p2p"; } > "$OUT/collectives-c-mpi-${N}ranks.txt"
echo "wrote $OUT/collectives-c-${N}ranks.txt and $OUT/collectives-c-mpi-${N}ranks.txt"
