"""Simulated hosts on one machine (for tests and `t3d-bench collectives --hosts`): each host is a network namespace
with its own host name (UTS), System V IPC and a private /dev/shm (a mount namespace with its own tmpfs), joined to
the others by veth links to a bridge; its addresses exist only inside those namespaces. Root only.

    with NetnsHosts(2) as hosts:                      # hosts.addr[0] = "10.a.b.1", ...
        results = hosts.run(fn, ranks_per_host=2)     # fn(rank, world, report) in every rank, in its host

`fn` is a module-level function (each rank imports its module by name, with that module's folder on its path). It
calls report(what, **fields) to send events back; run() returns {rank: [events...]}. hosts.cut(i) takes host i off the network (its link goes down:
nothing is refused, packets just stop, as in a partition); `on_event` lets a test act when an event arrives.

The ranks talk over UCX with TCP only (UCX_TLS=tcp): namespaces share one kernel, so UCX's shared-memory transports
would otherwise join ranks of different "hosts" and no byte would cross the link. t3d itself sees different host
names, so every group that spans hosts goes over UCX and its watch (base/watch.c)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time



def available() -> str:
    """'' when simulated hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command"
    probe = f"t3dprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class NetnsHosts:
    def __init__(self, n: int):
        self.n = n
        tag = os.getpid() % 100000
        self.ns = [f"t3d{tag}h{i}" for i in range(n)]
        self.bridge = f"t3db{tag}"
        self.links = [f"t3d{tag}v{i}" for i in range(n)]  # the host's end is eth0 inside its namespace
        subnet = 100 + tag % 150, tag // 150 % 250
        self.addr = [f"10.{subnet[0]}.{subnet[1]}.{i + 1}" for i in range(n)]
        self.made: list[str] = []

    def __enter__(self) -> "NetnsHosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.made.append("bridge")
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.ns):
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("link", "add", self.links[i], "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", self.links[i], "master", self.bridge)
                _ip("link", "set", self.links[i], "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.ns:
            if ns in self.made:
                subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if "bridge" in self.made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def exec(self, i: int, cmd: list[str], **kw) -> subprocess.Popen:
        """Starts cmd on host i (its network namespace only: for tools such as ucx_perftest)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns[i], *cmd], **kw)

    def cut(self, i: int) -> None:
        """Host i's link goes down at the bridge: its packets stop, nothing is refused or reset."""
        _ip("link", "set", self.links[i], "down")

    def run(self, fn, ranks_per_host: int, *, env=None, seconds=60.0, on_event=None, want=None, private=(),
            interleaved=False):
        """Runs fn in ranks_per_host ranks on every host (ranks numbered host by host, or round the hosts with
        `interleaved`: host h gets ranks h, h + hosts, ...) and collects their events
        until every rank in `want` (default: all) has sent a 'done' or 'raised' event, or `seconds` pass; then
        every rank process is ended. Each directory in `private` (it must exist) gets an empty tmpfs of its own on
        every host: hosts that share no filesystem there. Returns {rank: [event dicts]}."""
        world = self.n * ranks_per_host
        want = set(range(world)) if want is None else set(want)
        port = 29500 + os.getpid() % 20000
        with tempfile.TemporaryDirectory(prefix="t3d-netns-") as tmp:
            events_path = os.path.join(tmp, "events")
            open(events_path, "w").close()
            launchers = []
            for h in range(self.n):
                mod = sys.modules[fn.__module__]
                where = os.path.dirname(os.path.abspath(mod.__file__)) if getattr(mod, "__file__", None) else ""
                ranks = (list(range(h, world, self.n)) if interleaved
                         else list(range(h * ranks_per_host, (h + 1) * ranks_per_host)))
                spec = {"host": f"host{h}", "ranks": ranks,
                        "world": world, "master": self.addr[0], "port": port, "fn": [fn.__module__, fn.__name__],
                        "path": [where] + [p for p in sys.path if p and os.path.isdir(p)],
                        "events": events_path, "env": dict(env or {}), "private": list(private)}
                cmd = ["ip", "netns", "exec", self.ns[h], "unshare", "--uts", "--ipc", "--mount",
                       "--propagation", "private", sys.executable, os.path.abspath(__file__), json.dumps(spec)]
                launchers.append(subprocess.Popen(cmd, start_new_session=True))
            got: dict[int, list[dict]] = {r: [] for r in range(world)}
            finished: set[int] = set()
            deadline = time.monotonic() + seconds
            seen = 0
            try:
                while time.monotonic() < deadline and not want <= finished:
                    with open(events_path) as f:
                        lines = f.read().splitlines()
                    for line in lines[seen:]:
                        try:
                            ev = json.loads(line)
                        except ValueError:
                            break  # a line half written: read it next round
                        seen += 1
                        got[ev["rank"]].append(ev)
                        if ev["what"] in ("done", "raised"):
                            finished.add(ev["rank"])
                        if on_event is not None:
                            on_event(ev)
                    if all(p.poll() is not None for p in launchers):
                        break
                    time.sleep(0.05)
            finally:
                for p in launchers:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGTERM)
                for p in launchers:
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
            return got


# ---------- inside a host: the launcher and its ranks ----------

def _report_to(path: str, rank: int):
    def report(what: str, **fields) -> None:
        line = json.dumps({"rank": rank, "what": what, "t": time.time(), **fields}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line.encode())  # one write: lines of ranks never interleave
        finally:
            os.close(fd)
    return report


def _host_main(spec: dict) -> None:
    socket.sethostname(spec["host"])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "t3dshm", "/dev/shm"], check=True)
    for d in spec["private"]:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "t3dprivate", d], check=True)
    env = dict(os.environ)
    env.update({"MASTER_ADDR": spec["master"], "MASTER_PORT": str(spec["port"]), "WORLD_SIZE": str(spec["world"]),
                "UCX_TLS": "tcp", "OMP_NUM_THREADS": "1", "T3D_NETNS_SPEC": json.dumps(spec)})
    env["PYTHONPATH"] = os.pathsep.join([p for p in spec["path"] if p] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(spec["env"])
    procs = []
    for local, rank in enumerate(spec["ranks"]):
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(local))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank"], env=e))

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.kill()
        sys.exit(1)

    signal.signal(signal.SIGTERM, stop)
    for p in procs:
        p.wait()


def _rank_main() -> None:
    import importlib

    spec = json.loads(os.environ["T3D_NETNS_SPEC"])
    rank = int(os.environ["RANK"])
    report = _report_to(spec["events"], rank)
    mod, name = spec["fn"]
    fn = getattr(importlib.import_module(mod), name)
    try:
        fn(rank, spec["world"], report)
    except BaseException as exc:  # noqa: BLE001
        report("crashed", error=f"{type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    # Run as a script: its folder (the t3d package) must not stand in for top-level modules of the ranks.
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    if sys.argv[1] == "--rank":
        _rank_main()
    else:
        _host_main(json.loads(sys.argv[1]))
