# Launcher for the Python tests: runs a function (or an ordered list of named checks) in N real processes that join
# one process group over a FileStore, with hard deadlines, so a hang or a crash fails the test instead of blocking it.
import os
import queue as queue_mod
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import multiprocessing as mp
import multiprocessing.connection  # noqa: F401  (mp.connection.wait)

BACKEND = os.environ.get("T3D_TEST_BACKEND", "t3d")
PG_TIMEOUT_S = 60
SYNC_AFTER_FAIL_S = 8
CHILD_ENV = {
    # Tests start up to 8 ranks on a 2-core machine: intra-op threads in every rank would only fight for the cores.
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "T3D_TEST_BACKEND": BACKEND,
    "TORCH_DISTRIBUTED_DEBUG": "OFF",
    "PYTHONUNBUFFERED": "1",
}

# Set inside a child: the queue back to the parent and this rank, so that checks can report progress.
_child_queue = None
_child_rank = None


class WorldFailure(AssertionError):
    pass


def is_gloo():
    return BACKEND == "gloo"


def scratch_dir(prefix="t3d-test-"):
    return tempfile.mkdtemp(prefix=prefix)


def _put(msg):
    # A synchronous write: a rank that crashes right after must not lose what it said before.
    if _child_queue is not None:
        _child_queue.send(msg)


def _flush_and_exit(code):
    try:
        _child_queue.close()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _child_main(rank, world_size, backend, init_file, q, mode, payload, args, import_t3d=True, env=None):
    global _child_queue, _child_rank
    _child_queue, _child_rank = q, rank
    if env is not None:
        # A fork of the server (_context): the environment the parent had when it started this world.
        os.environ.clear()
        os.environ.update(env)
    try:
        import torch
        torch.set_num_threads(1)
        if backend == "t3d" and import_t3d:
            import t3d  # noqa: F401  (registers the backend)
        import torch.distributed as dist
        dist.init_process_group(backend, init_method="file://" + init_file, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=PG_TIMEOUT_S))
    except BaseException:
        _put(("error", rank, None, "process group init failed:\n" + traceback.format_exc()))
        _flush_and_exit(1)
    _put(("ready", rank))
    if mode == "fn":
        try:
            result = payload(rank, world_size, *args)
        except BaseException:
            _put(("error", rank, None, traceback.format_exc()))
            _flush_and_exit(1)
        _put(("result", rank, result))
    else:
        # Marker files (not the backend under test) tell a rank that failed a check whether its peers got out of
        # that check too; if they did, the world is still in step and the next checks can run.
        marks = init_file + ".marks"
        os.makedirs(marks, exist_ok=True)
        for idx, (name, fn, fargs) in enumerate(payload):
            _put(("start", rank, name))
            try:
                fn(rank, world_size, *fargs)
                ok = True
            except BaseException:
                ok = False
                _put(("fail", rank, name, traceback.format_exc()))
            open(os.path.join(marks, f"{idx}.{rank}"), "w").close()
            if ok:
                _put(("pass", rank, name))
                continue
            t_end = time.monotonic() + SYNC_AFTER_FAIL_S
            while not all(os.path.exists(os.path.join(marks, f"{idx}.{r}")) for r in range(world_size)):
                if time.monotonic() > t_end:
                    # Peers are stuck in a collective this rank left: the parent ends the world, starts another.
                    _put(("abandon", rank, name))
                    _flush_and_exit(1)
                time.sleep(0.05)
    try:
        dist.destroy_process_group()
    except BaseException:
        _put(("error", rank, "destroy_process_group", traceback.format_exc()))
        _flush_and_exit(1)
    _put(("done", rank))
    _flush_and_exit(0)


# Worlds on backend t3d start their ranks as forks of a server that imported torch once, instead of as new
# interpreters that each import it (about 2.5 s of one core per rank; the suite starts hundreds of ranks). The server
# imports torch without the t3d entry point, so each rank imports t3d itself after taking the parent's environment
# of that moment (libt3d reads its variables at first use; torch's own import-time variables are CHILD_ENV's and
# the suite's, the same for every world). Worlds that test the entry point (import_t3d=False) or another backend
# are spawned as before; T3D_TEST_SPAWN=1 spawns every world.
_server_started = False


def _context(backend, import_t3d):
    """The start method for a world, and the environment its forked ranks take (None: spawned, they inherit it).
    Sets TORCH_DEVICE_BACKEND_AUTOLOAD for the server's start; the caller restores it with the variables it sets."""
    global _server_started
    if backend != "t3d" or not import_t3d or os.environ.get("T3D_TEST_SPAWN") == "1":
        return mp.get_context("spawn"), None
    env = dict(os.environ)
    ctx = mp.get_context("forkserver")
    if not _server_started:
        from multiprocessing import forkserver

        os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        forkserver.ensure_running()
        _server_started = True
    return ctx, env


class _World:
    """One launch: processes, the queue, and what each rank reported."""

    def __init__(self, world_size, mode, payload, args, backend, import_t3d=True):
        self.ws = world_size
        self.dir = tempfile.mkdtemp(prefix="t3d-world-")
        init_file = os.path.join(self.dir, "init")
        saved = {k: os.environ.get(k) for k in (*CHILD_ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD")}
        os.environ.update(CHILD_ENV)
        if backend != "t3d":
            # The installed t3d package registers a torch.backends entry point: keep other backends' runs free of it.
            os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        self.conns = {}
        try:
            self.ctx, env = _context(backend, import_t3d)
            self.procs = []
            for r in range(world_size):
                reader, writer = self.ctx.Pipe(duplex=False)
                p = self.ctx.Process(target=_child_main, name=f"rank{r}",
                                     args=(r, world_size, backend, init_file, writer, mode, payload, args, import_t3d,
                                           env))
                p.daemon = True
                p.start()
                writer.close()
                self.conns[reader] = r
                self.procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.ready = set()
        self.done = set()
        self.results = {}
        self.errors = {}          # rank -> (where, traceback) for failures outside checks
        self.current = {}         # rank -> check it last started
        self.passed = {}          # check -> set of ranks
        self.fails = []           # (time, rank, check, traceback) in arrival order
        self.failed_checks = set()
        self.abandoned = {}       # rank -> check: ranks that left after a failure their peers did not get past
        self.last_msg = time.monotonic()
        self.bad_since = None     # when a rank left or died: later failures of other checks may be only echoes

    def poll(self, wait):
        """Handles the messages that arrive within `wait` seconds; False when none did."""
        if not self.conns:
            time.sleep(wait)
            return False
        got = False
        for c in mp.connection.wait(list(self.conns), timeout=wait):
            try:
                msg = c.recv()
            except (EOFError, OSError):
                del self.conns[c]
                continue
            got = True
            self._handle(msg)
        return got

    def _handle(self, msg):
        self.last_msg = time.monotonic()
        kind, rank = msg[0], msg[1]
        if kind == "ready":
            self.ready.add(rank)
        elif kind == "start":
            self.current[rank] = msg[2]
        elif kind == "pass":
            self.passed.setdefault(msg[2], set()).add(rank)
            self.current.pop(rank, None)
        elif kind == "fail":
            self.fails.append((time.monotonic(), rank, msg[2], msg[3]))
            self.current.pop(rank, None)
            self.failed_checks.add(msg[2])
        elif kind == "abandon":
            self.abandoned[rank] = msg[2]
            self.mark_bad()
        elif kind == "result":
            self.results[rank] = msg[2]
        elif kind == "error":
            self.errors[rank] = (msg[2], msg[3])
        elif kind == "done":
            self.done.add(rank)

    def mark_bad(self):
        if self.bad_since is None:
            self.bad_since = time.monotonic()

    def drain(self, wait=0.3):
        while self.poll(wait):
            pass

    def crashed(self):
        """Ranks whose process ended without saying it was done or why it stopped."""
        out = []
        for r, p in enumerate(self.procs):
            if not p.is_alive() and r not in self.done and r not in self.errors and r not in self.abandoned:
                out.append((r, p.exitcode))
        return out

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        for c in list(self.conns):
            c.close()
        self.conns.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, deadline_s, idle_s, startup_s, grace_s, fail_ends=True):
        """Collects messages until every rank is done, something fails, or a deadline passes.
        Returns None when all ranks finished, else a short reason string."""
        t0 = time.monotonic()
        first_bad = None
        while True:
            self.poll(0.1)
            now = time.monotonic()
            if len(self.done) == self.ws:
                return None
            if first_bad is None and ((self.fails and fail_ends) or self.errors or self.abandoned):
                first_bad = now
            if first_bad is None:
                gone = self.crashed()
                if gone:
                    self.drain()
                    gone = self.crashed()
                    if gone:
                        first_bad = now
                        self.mark_bad()
                        self.errors.update({r: (None, f"process exited with code {c} without a report"
                                                      + (f" (killed by signal {-c})" if c and c < 0 else ""))
                                            for r, c in gone})
            if first_bad is not None and now - first_bad > grace_s:
                return "failure"
            if first_bad is not None and all(not p.is_alive() for p in self.procs):
                self.drain()
                return "failure"
            if now - t0 > deadline_s:
                return "deadline"
            limit = startup_s if len(self.ready) < self.ws else idle_s
            if now - self.last_msg > limit:
                return "idle"


def _describe_stuck(w, reason, deadline_s, idle_s, startup_s):
    not_ready = sorted(set(range(w.ws)) - w.ready)
    if not_ready:
        return (f"ranks {not_ready} did not finish init_process_group within {startup_s:.0f}s "
                f"(backend {BACKEND!r}); they were killed")
    not_done = sorted(set(range(w.ws)) - w.done)
    what = f"no progress for {idle_s:.0f}s" if reason == "idle" else f"hard deadline {deadline_s:.0f}s passed"
    if w.current:
        where = {r: w.current.get(r) for r in not_done}
        return f"{what}: ranks {not_done} hung (current check per rank: {where}); all ranks were killed"
    returned = sorted(w.results)
    in_fn = sorted(set(not_done) - set(returned))
    msg = f"{what}: "
    if in_fn:
        msg += f"ranks {in_fn} hung in the test function"
    if set(returned) - w.done:
        msg += ("; " if in_fn else "") + \
            f"ranks {sorted(set(returned) - w.done)} returned but hung in destroy_process_group"
    return msg + "; all ranks were killed"


def run_world(fn, world_size, *args, timeout=120.0, idle=None, backend=None, import_t3d=True):
    """Runs fn(rank, world_size, *args) on world_size processes in one process group and returns the list of
    per-rank return values. Fails (WorldFailure) with the child's traceback, or naming the ranks that hung."""
    backend = backend or BACKEND
    startup = 30.0 + 8.0 * world_size
    w = _World(world_size, "fn", fn, args, backend, import_t3d)
    try:
        reason = w.run(deadline_s=timeout + startup, idle_s=idle or timeout, startup_s=startup, grace_s=5.0)
        if reason is None:
            return [w.results[r] for r in range(world_size)]
        if w.errors:
            parts = [f"--- rank {r}" + (f" ({where})" if where else "") + f" ---\n{tb}"
                     for r, (where, tb) in sorted(w.errors.items())]
            others = sorted(set(range(world_size)) - set(w.errors) - w.done)
            tail = f"\n(ranks {others} were still running and were killed)" if others else ""
            raise WorldFailure(f"world of {world_size} failed on backend {backend!r}:\n" + "\n".join(parts) + tail)
        raise WorldFailure(f"world of {world_size} on backend {backend!r}: "
                           + _describe_stuck(w, reason, timeout + startup, idle or timeout, startup))
    finally:
        w.kill()


class CheckOutcome:
    def __init__(self, status, detail=""):
        self.status = status      # "pass", "fail", "hang", "notrun"
        self.detail = detail


def run_checks(checks, world_size, *, backend=None, idle=40.0, budget=220.0, max_launches=25):
    """Runs an ordered list of (name, fn, args) checks in one world; each fn(rank, world_size, *args) runs on every
    rank. A check that raises on some rank fails; the world goes on when all ranks got past it, else it is ended
    and a new one runs the checks that had not completed. Returns {name: CheckOutcome}."""
    backend = backend or BACKEND
    startup = 30.0 + 8.0 * world_size
    outcomes = {}
    remaining = list(checks)
    t_start = time.monotonic()
    launches = 0
    while remaining:
        spent = time.monotonic() - t_start
        if launches >= max_launches or (launches and spent > budget):
            for name, _, _ in remaining:
                outcomes[name] = CheckOutcome("notrun", f"not run: {launches} launches / {spent:.0f}s spent on "
                                                        f"this world after earlier failures or hangs")
            break
        launches += 1
        w = _World(world_size, "checks", remaining, (), backend)
        try:
            reason = w.run(deadline_s=max(60.0, budget - spent) + startup, idle_s=idle, startup_s=startup,
                           grace_s=3.0, fail_ends=False)
        finally:
            w.kill()
        names = [c[0] for c in remaining]
        everyone = set(range(world_size))
        # Once a rank has left or died, failures of other checks are mostly peers losing their connection to it:
        # those checks run again in the next world.
        root = set(w.abandoned.values()) | {w.current[r] for r in w.errors if r in w.current}
        w.fails = [f for f in w.fails if w.bad_since is None or f[0] <= w.bad_since or f[2] in root]
        w.failed_checks = {f[2] for f in w.fails}
        for name in names:
            if name in w.failed_checks:
                tbs = [f"--- rank {r} ---\n{tb}" for _, r, n, tb in w.fails if n == name]
                tbs += [f"--- rank {r} ---\n{tb}" for r, (_, tb) in sorted(w.errors.items())
                        if w.current.get(r) == name]
                ok = sorted(w.passed.get(name, set()))
                silent = sorted(everyone - w.passed.get(name, set()) - {r for _, r, n, _ in w.fails if n == name})
                tail = (f"\n(ranks {ok} passed this check)" if ok else "") + \
                       (f"\n(ranks {silent} never finished this check; the world was ended)" if silent else "")
                outcomes[name] = CheckOutcome("fail", "\n".join(tbs) + tail)
            elif w.passed.get(name, set()) == everyone:
                outcomes[name] = CheckOutcome("pass")
        if reason is None:
            remaining = [c for c in remaining if c[0] not in outcomes]
            if remaining:  # every rank said done, yet some check has no verdict: should not happen
                for name, _, _ in remaining:
                    outcomes[name] = CheckOutcome("fail", "world finished without a verdict for this check")
            break
        pending = [n for n in names if n not in outcomes]
        if len(w.ready) < world_size:
            detail = (_describe_stuck(w, reason, budget, idle, startup) if not w.errors else
                      "\n".join(f"--- rank {r} ---\n{tb}" for r, (_, tb) in sorted(w.errors.items())))
            for n in pending:
                outcomes[n] = CheckOutcome("fail", "world failed before any check ran:\n" + detail)
            break
        charged = None
        crashed = {r: tb for r, (where, tb) in w.errors.items()}
        in_flight = {r: w.current[r] for r in w.current if w.current[r] in pending}
        if crashed:
            where = [in_flight[r] for r in crashed if r in in_flight]
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(crashed.items()))
            if where:
                charged = min(where, key=names.index)
                outcomes[charged] = CheckOutcome("fail", msg)
            elif not pending:
                outcomes["destroy_process_group"] = CheckOutcome("fail", msg)
                break
        elif reason in ("idle", "deadline"):
            cands = sorted(set(in_flight.values()), key=names.index) or pending[:1]
            if cands:
                charged = cands[0]
                laggards = sorted(everyone - w.passed.get(charged, set()))
                outcomes[charged] = CheckOutcome(
                    "hang", f"check {charged!r} hung on ranks {laggards}: "
                            + _describe_stuck(w, reason, budget, idle, startup))
            else:
                outcomes["destroy_process_group"] = CheckOutcome(
                    "hang", "destroy_process_group hung: " + _describe_stuck(w, reason, budget, idle, startup))
                break
        progressed = charged is not None or any(n in outcomes for n in names)
        remaining = [c for c in remaining if c[0] not in outcomes]
        if not progressed:
            for name, _, _ in remaining:
                outcomes[name] = CheckOutcome("fail", f"world ended ({reason}) with no check completing")
            break
    return outcomes


def assert_outcome(outcomes, name):
    import pytest
    o = outcomes.get(name)
    if o is None and name == "destroy_process_group":
        return
    if o is None:
        pytest.fail(f"check {name!r} produced no outcome")
    if o.status == "pass":
        return
    if o.status == "notrun":
        pytest.fail(o.detail, pytrace=False)
    pytest.fail(f"[{BACKEND}] check {name!r} {o.status}:\n{o.detail}", pytrace=False)


def world_outcomes(cache, key, checks, world_size, **kw):
    """Runs the checks once per key per session; later tests read the cached outcome."""
    if key not in cache:
        cache[key] = run_checks(checks, world_size, **kw)
    return cache[key]


def check_params(spec, world8_mark=None):
    """pytest params (ws, name) for {ws: [(name, fn, args, skip_reason)]}, in run order, plus one item per world
    for destroy_process_group. Worlds of 8 ranks carry the world8 mark."""
    import pytest
    ps = []
    for ws, checks in spec.items():
        marks = [pytest.mark.world8] if ws >= 8 else []
        for name, _, _, skip in checks:
            m = marks + ([pytest.mark.skip(reason=skip)] if skip else [])
            ps.append(pytest.param(ws, name, marks=m, id=f"ws{ws}-{name}"))
        ps.append(pytest.param(ws, "destroy_process_group", marks=marks, id=f"ws{ws}-destroy_process_group"))
    return ps


def run_check_item(cache, key, spec, ws, name, **kw):
    """Body of a parametrized check test: runs the world for (key, ws) once, then asserts this check's outcome."""
    checks = [(n, fn, args) for n, fn, args, skip in spec[ws] if not skip]
    outcomes = world_outcomes(cache, (key, ws), checks, ws, **kw)
    assert_outcome(outcomes, name)


def spawn_reports(target, world, extra_args, want, seconds=90.0, ignore=("ready", "idle")):
    """Starts `world` spawned processes running target(rank, init_file, *extra_args, q) and collects the reports
    they put on q, (rank, what, seconds, message), until every rank in `want` has reported something other than
    `ignore` or `seconds` pass; ranks that reported get a few seconds to exit, the others are killed. Returns {rank: (what, seconds, message)}: the
    caller asserts that every rank it wanted is there (a missing one hung)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=target, args=(r, init, *extra_args, q)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + seconds
            while not set(want) <= set(got) and time.monotonic() < deadline:
                try:
                    rank, what, dt, msg = q.get(timeout=1)
                except queue_mod.Empty:
                    continue
                if what not in ignore:
                    got[rank] = (what, dt, msg)
        finally:
            for r, p in enumerate(procs):
                p.join(timeout=5 if r in got else 0)  # a rank that reported exits by itself; the others are ended
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return got
