#!/usr/bin/env bash
# Where the CPU time of a training step goes, on every core at once: perf samples the whole machine while t3d-train
# runs (from a few seconds after its first step, for a window inside the loop), and scripts/perf_step_summary.py
# groups the samples by what ran (the Python interpreter, torch's C++, tensor kernels, the backend's library, the
# kernel's scheduling and networking, idle cores) and turns the shares into core-milliseconds per step.
#
# Usage: scripts/profile-step.sh [BACKEND] [t3d-train arguments...]
#   e.g. scripts/profile-step.sh t3d; scripts/profile-step.sh gloo; scripts/profile-step.sh t3d --dp 1 --cp 1
# Needs perf (Debian: linux-perf) and permission to sample every CPU (root, or kernel.perf_event_paranoid <= 0).
# PROFILE_WARM_S (default 3) and PROFILE_WINDOW_S (default 10) set the window, which ends earlier where the loop would
# (the step count is chosen for 0.1 s a step); the steps logged inside it give the step time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BACKEND="${1:-t3d}"
[ $# -gt 0 ] && shift
WARM="${PROFILE_WARM_S:-3}"
WINDOW="${PROFILE_WINDOW_S:-10}"
if ! command -v perf > /dev/null; then
  echo "profile-step: perf is not installed (Debian: apt-get install linux-perf)" >&2
  exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
VENV="$("$ROOT/scripts/setup.sh" 2> "$work/setup.log" | tail -n 1)" || { cat "$work/setup.log" >&2; exit 1; }
CORES="$(getconf _NPROCESSORS_ONLN)" # not nproc, which follows OMP_NUM_THREADS
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkfifo "$work/ctl"
# Steps enough for the window at 0.1 s a step or more. A faster loop ends the window early (below): the samples must
# all fall inside the loop, not in the checkpoint and the exit after it.
steps=$(( (WARM + WINDOW) * 10 + 10 ))
perf record -q -a -F 499 -D -1 --control "fifo:$work/ctl" -o "$work/perf.data" -- \
  "$VENV/bin/python" -m t3d.train --backend "$BACKEND" --steps "$steps" --no-progress --ckpt-dir "$work/ckpt" "$@" \
  > "$work/train.log" 2>&1 &
pid=$!
# Read-write, so that opening it never waits for perf (a perf that failed to start would leave no reader).
exec 3<> "$work/ctl"
for _ in $(seq 600); do
  grep -q "step 1 on rank 0" "$work/train.log" 2> /dev/null && break
  kill -0 "$pid" 2> /dev/null || break
  sleep 0.5
done
if ! grep -q "step 1 on rank 0" "$work/train.log"; then
  cat "$work/train.log" >&2
  echo "profile-step: the loop never started" >&2
  exit 1
fi
# The last step rank 0 has logged ("step   N/M | ..."), 0 before the first.
last_step() { sed -n 's/^step *\([0-9]*\)\/[0-9]* |.*/\1/p' "$work/train.log" | tail -1 | grep . || echo 0; }
sleep "$WARM"
echo enable >&3
t0="$(date +%s%N)"
s0="$(last_step)"
# The window: WINDOW seconds, or until the loop is two steps from its end, whichever comes first.
while :; do
  sleep 0.1
  elapsed_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  s1="$(last_step)"
  [ "$elapsed_ms" -ge $((WINDOW * 1000)) ] || [ "$s1" -ge $((steps - 2)) ] && break
  kill -0 "$pid" 2> /dev/null || break
done
echo disable >&3
wait "$pid" || { tail -20 "$work/train.log" >&2; echo "profile-step: t3d-train failed" >&2; exit 1; }
exec 3>&-
if [ "$s1" -le "$s0" ]; then
  echo "profile-step: no step finished inside the window" >&2
  exit 1
fi
# Core-ms per step from the window itself: its length over the steps logged inside it.
step_ms="$(( elapsed_ms / (s1 - s0) )).$(( elapsed_ms * 10 / (s1 - s0) % 10 ))"
grep -E "^summary|step time" "$work/train.log"
echo "  profiled window: $((elapsed_ms / 1000)).$((elapsed_ms / 100 % 10)) s, steps $((s0 + 1))-$s1 of $steps," \
  "$step_ms ms a step"
"$VENV/bin/python" "$ROOT/scripts/perf_step_summary.py" "$work/perf.data" --backend "$BACKEND" --step-ms "$step_ms" \
  --cores "$CORES"
