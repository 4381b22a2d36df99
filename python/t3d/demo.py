"""A short working demo of t3d on CPU: N processes on backend "t3d" run every collective with a check, then train a
small model with DDP and with tensor parallelism (DTensor) on a 2-D DeviceMesh, printing loss per step.

    python -m t3d.demo [--nproc 4] [--steps 20]

This stands in for the main job until `t3d-train` (the 3D-parallel workflow) exists.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta


def _collectives(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    done = []
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.all(x == world * (world + 1) / 2), "all_reduce SUM"
    y = torch.full((7,), float(rank + 1))
    dist.all_reduce(y, op=dist.ReduceOp.AVG)
    assert torch.allclose(y, torch.full((7,), (world + 1) / 2)), "all_reduce AVG"
    done.append("all_reduce(SUM, AVG)")

    out = torch.empty(world * 3, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.full((3,), rank, dtype=torch.int64))
    assert out.tolist() == [r for r in range(world) for _ in range(3)], "all_gather_into_tensor"
    done.append("all_gather")

    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * world) + rank)
    expect = torch.arange(2.0 * rank, 2.0 * rank + 2) * world + sum(range(world))
    assert torch.equal(rs, expect), "reduce_scatter_tensor"
    done.append("reduce_scatter")

    # Uneven all_to_all: rank r sends (p + 1) elements to rank p.
    in_splits = [p + 1 for p in range(world)]
    out_splits = [rank + 1] * world
    inp = torch.cat([torch.full((p + 1,), float(rank * 10 + p)) for p in range(world)])
    outp = torch.empty(sum(out_splits))
    dist.all_to_all_single(outp, inp, out_splits, in_splits)
    assert torch.equal(outp, torch.cat([torch.full((rank + 1,), float(s * 10 + rank)) for s in range(world)]))
    done.append("all_to_all (uneven)")

    b = torch.tensor([42.0]) if rank == 0 else torch.zeros(1)
    dist.broadcast(b, src=0)
    assert b.item() == 42.0
    done.append("broadcast")

    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        recv = torch.empty(4)
        ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank)), nxt),
               dist.P2POp(dist.irecv, recv, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert torch.all(recv == prv)
        done.append("batch_isend_irecv (ring)")
    dist.barrier()
    done.append("barrier")
    return done


def _ddp(rank: int, world: int, steps: int) -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.linspace(-1, 1, 16)
    losses = []
    for _ in range(steps):
        xb = torch.randn(32, 16, generator=gen)
        yb = (xb @ w_true).unsqueeze(1) * 0.5
        loss = torch.nn.functional.mse_loss(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        losses.append(avg.item())
    return losses


def _tp(rank: int, world: int, steps: int) -> list[float] | None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if world % 2:
        return None
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dp_rank = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(99 + dp_rank)
    losses = []
    for _ in range(steps):
        xb = torch.randn(32, 16, generator=gen)
        yb = xb.sum(1, keepdim=True).tanh()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # data-parallel gradient average over "dp"
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        losses.append(avg.item())
    return losses


def _worker(rank: int, world: int, init_file: str, steps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import t3d  # noqa: F401  (registers the backend; the entry point would too)

    torch.set_num_threads(1)
    dist.init_process_group("t3d", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        t0 = time.perf_counter()
        colls = _collectives(rank, world)
        ddp = _ddp(rank, world, steps)
        tp = _tp(rank, world, steps)
        queue.put((rank, colls, ddp, tp, time.perf_counter() - t0, None))
    except Exception as exc:  # report, do not hang the others
        import traceback

        queue.put((rank, None, None, None, 0.0, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4, help="number of CPU processes (ranks)")
    ap.add_argument("--steps", type=int, default=20, help="training steps for each model")
    args = ap.parse_args(argv)

    import torch.multiprocessing as mp

    import t3d

    info = t3d.build_info()
    print(f"t3d {info['version']} (torch {info['torch_built']}, UCX {info['ucx_version']}); "
          f"{args.nproc} ranks on {os.cpu_count()} cores")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, args.nproc, init_file, args.steps, queue))
                 for r in range(args.nproc)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.time() + 600
        while len(results) < args.nproc and time.time() < deadline:
            try:
                item = queue.get(timeout=5)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            results[item[0]] = item
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = [r for r, item in results.items() if item[5]]
    if len(results) < args.nproc or failed:
        for r in failed:
            print(f"rank {r} failed:\n{results[r][5]}", file=sys.stderr)
        missing = sorted(set(range(args.nproc)) - set(results))
        if missing:
            print(f"ranks {missing} did not report", file=sys.stderr)
        return 1
    _, colls, ddp, tp, elapsed, _ = results[0]
    print("collectives checked: " + ", ".join(colls))
    print(f"DDP ({args.nproc} ranks), loss by step:")
    print("  " + " ".join(f"{v:.4f}" for v in ddp))
    if tp is not None:
        print(f"tensor parallel (dp {args.nproc // 2} x tp 2 DeviceMesh), loss by step:")
        print("  " + " ".join(f"{v:.4f}" for v in tp))
    print(f"done in {elapsed:.1f} s on rank 0; DDP loss {ddp[0]:.4f} -> {ddp[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
