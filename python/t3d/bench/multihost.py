"""`t3d-bench collectives --hosts H`: the collective benchmark on H simulated hosts (t3d.netns: network namespaces
with their own host names, IPC and /dev/shm, joined by veth links to a bridge; root only), --nproc ranks on each.

t3d and gloo run the same rows as on one host, over the same link, taking turns (--repeat); `t3d-flat` is t3d with
its two-level collectives off (T3D_HIER=0: every rank over UCX, also between ranks of one host). ucx_perftest (UCX's
own tool, tag bandwidth between host 0 and host 1, UCX_TLS=tcp as for the ranks) measures what the link carries.
The table gives each row's time and busbw per backend, each peer's time over t3d's, and the link's floor over
t3d's time: the least time the bytes that must cross between hosts take at the link's bandwidth (for H hosts,
size x 2(H-1)/H for all_reduce, (H-1)/H for all_gather and reduce_scatter, 1 for broadcast: nccl-tests' bus
factors with hosts for ranks), i.e. the share of the link t3d's row uses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from .. import netns
from .collectives import _rank_main, median_rows, output_dir, parse_size, plot as plot_busbw, save_run, sizes_between
from .opspec import OPS, bus_factor


class _Rows:
    """What _rank_main hands its result to (a queue on one host): here the rank's report."""

    def __init__(self, report):
        self.report = report

    def put(self, rows):
        self.report("rows", rows=rows)


def _netns_rank(rank: int, world: int, report) -> None:
    spec = json.loads(os.environ["T3D_BENCH_SPEC"])
    _rank_main(rank, world, spec["backend"], None, spec["ops"], spec["sizes"], _Rows(report))
    report("done")
    os._exit(0)  # past destroy_process_group: nothing left to wait for


BACKENDS = ("t3d", "t3d-flat", "gloo")


def run_backend(hosts: netns.NetnsHosts, backend: str, nproc: int, ops: list[str], sizes: list[int],
                timeout: float) -> list[dict]:
    env = {"T3D_BENCH_SPEC": json.dumps({"backend": backend.split("-")[0], "ops": ops, "sizes": sizes}),
           "GLOO_SOCKET_IFNAME": "eth0"}
    if backend == "t3d-flat":
        env["T3D_HIER"] = "0"
    got = hosts.run(_netns_rank, nproc, env=env, seconds=timeout)
    for ev in got[0]:
        if ev["what"] == "rows":
            return ev["rows"]
    bad = {r: [e for e in evs if e["what"] in ("crashed", "raised")] for r, evs in got.items()}
    raise RuntimeError(f"backend {backend}: no result within {timeout:.0f} s: {bad}")


def _perftest_rate(out: str) -> float | None:
    m = re.search(r"^Final:\s+(\d+)\s+\S+\s+\S+\s+\S+\s+\S+\s+(\S+)", out, re.M)
    return float(m.group(2)) * (1 << 20) if m else None  # its MB/s are 2^20 bytes per second


def link_bandwidth(hosts: netns.NetnsHosts, size: int, both_ways: bool = False, iters: int = 20) -> float | None:
    """Bytes/s that ucx_perftest's tag_bw moves between host 0 and host 1 in messages of `size` bytes: from host 0 to
    host 1, or with `both_ways` the mean of the two directions while both carry at once (two pairs of the tool); None
    when the tool is missing or failed."""
    tool = shutil.which("ucx_perftest")
    if tool is None:
        return None
    base = 13000 + os.getpid() % 2000
    env = dict(os.environ, UCX_TLS="tcp")
    pairs = [(0, 1, base), (1, 0, base + 1)] if both_ways else [(0, 1, base)]
    args = ["-t", "tag_bw", "-s", str(size), "-n", str(iters)]
    servers = [hosts.exec(dst, [tool] + args + ["-p", str(port)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) for _, dst, port in pairs]
    try:
        for _ in range(20):  # the servers need a moment to listen
            time.sleep(0.5)
            clients = [hosts.exec(src, [tool, hosts.addr[dst]] + args + ["-p", str(port)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                       for src, dst, port in pairs]
            rates = [_perftest_rate(c.communicate(timeout=120)[0]) for c in clients]
            if all(r is not None for r in rates):
                return sum(rates) / len(rates)
            if any(r is not None for r in rates):
                return None  # one side ran without the other: not a both-ways figure
        return None
    finally:
        for server in servers:
            server.kill()
            server.wait()


def render(results: dict, world: int, hosts: int, link: float | None, duplex: float | None = None) -> str:
    lines = [f"# t3d-bench collectives on {hosts} simulated hosts x {world // hosts} ranks (UCX over TCP between "
             f"hosts; veth link)", ""]
    if link:
        lines.append(f"Link: {link / 1e9:.2f} GB/s one way (ucx_perftest tag_bw, 64 MiB messages, host 0 -> host 1)"
                     + (f"; {duplex / 1e9:.2f} GB/s each way when both directions carry at once (two pairs of the "
                        "tool; on simulated hosts the link's copies run on the same cores as the ranks and the tool's "
                        "busy-polling, so this is what the link gives both ways here, not a floor)."
                        if duplex else "."))
    else:
        lines.append("Link: not measured (ucx_perftest missing or failed).")
    lines.append("'t3d-flat': t3d with its two levels off (T3D_HIER=0). 'X / t3d': X's time over t3d's. 'link floor / "
                 "t3d': the least time the bytes that must cross between hosts take at the link's one-way bandwidth "
                 "(size x 2(H-1)/H for all_reduce, (H-1)/H for all_gather and reduce_scatter, 1 for broadcast), over "
                 "t3d's time.")
    names = [b for b in BACKENDS if b in results]
    peers = [b for b in names if b != "t3d"]
    tables = {b: {(r["op"], r["bytes"]): r for r in results[b]} for b in names}
    head = ["op", "size"] + [f"{b} {what}" for b in names for what in ("time (us)", "busbw (GB/s)")]
    head += [f"{b} / t3d" for b in peers] + ["link floor / t3d"]
    lines += ["", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    keys = set().union(*tables.values()) if tables else set()
    for key in sorted(keys, key=lambda k: (OPS.index(k[0]), k[1])):
        op, size = key
        cells = []
        for b in names:
            r = tables[b].get(key)
            if r is None:
                cells += ["-", "-"]
                continue
            busbw = size / (r["time_us"] * 1e-6) * bus_factor(op, world) / 1e9
            cells += [f"{r['time_us']:.1f}" + (" WRONG" if r["wrong"] else ""), f"{busbw:.2f}"]
        t3d = tables.get("t3d", {}).get(key)
        for b in peers:
            r = tables[b].get(key)
            cells.append(f"{r['time_us'] / t3d['time_us']:.2f}" if r and t3d else "-")
        floor_s = size * bus_factor(op, hosts) / link if link else None
        cells.append(f"{floor_s / (t3d['time_us'] * 1e-6):.0%}" if floor_s and t3d else "-")
        lines.append(f"| {op} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: str) -> None:
    """The run's busbw plot (as one host's), its panels naming the hosts."""
    hosts, nproc = data["hosts"], data["nproc"]
    plot_busbw(data["results"], hosts * nproc, path, ranks=f"{hosts} hosts x {nproc} ranks")


def run(args) -> int:
    why = netns.available()
    if why:
        print(f"t3d-bench: --hosts: simulated hosts are not available here: {why}", file=sys.stderr)
        return 2
    if args.hosts < 2:
        print(f"t3d-bench: --hosts must be at least 2, not {args.hosts}", file=sys.stderr)
        return 2
    ops = [o for o in args.ops.split(",") if o and o in OPS]
    sizes = sizes_between(parse_size(args.min), parse_size(args.max))
    backends = [b for b in args.backends.split(",") if b in BACKENDS]
    world = args.hosts * args.nproc
    runs: dict = {b: [] for b in backends}
    with netns.NetnsHosts(args.hosts) as hosts:
        link = link_bandwidth(hosts, 64 << 20)
        duplex = link_bandwidth(hosts, 64 << 20, both_ways=True)
        for rep in range(max(1, args.repeat)):
            for b in backends:
                t0 = time.time()
                runs[b].append(run_backend(hosts, b, args.nproc, ops, sizes, args.timeout))
                print(f"{b}: {len(runs[b][-1])} rows in {time.time() - t0:.0f} s (run {rep + 1})", flush=True)
    results = {b: median_rows(runs[b]) for b in backends if runs[b]}
    md = render(results, world, args.hosts, link, duplex)
    print(md)
    data = {"hosts": args.hosts, "nproc": args.nproc, "link_bytes_per_s": link, "link_both_ways_bytes_per_s": duplex,
            "results": results, "when": time.strftime("%Y-%m-%d %H:%M")}
    stem = save_run(output_dir(args.out), args.tag or f"collectives-{args.hosts}hosts-{args.nproc}ranks", data, md)
    plot(data, stem + ".png")
    print(f"saved {stem}.json, .md, .png")
    return 0
