"""One rank of backend t3d on CUDA tensors, through NCCL (a step of scripts/gpu-check.sh).

init_process_group("t3d") with world size 1, then all_reduce (SUM, MAX, AVG, PREMUL_SUM), broadcast,
all_gather_into_tensor and reduce_scatter_tensor on CUDA tensors of several sizes and dtypes: every result is
checked against what one rank must get, and each call is timed with CUDA events (beside torch's own NCCL backend at
one rank, when torch has it). Prints markdown; exits 1 if any check failed.

If torch has not loaded a libnccl by the time the GPU is initialised and T3D_NCCL_LIBRARY is unset, T3D_NCCL_LIBRARY
is pointed at the libnccl.so.2 of the nvidia-nccl-cu13 (or -cu12) wheel before the first CUDA collective.
"""
import os
import sys
import tempfile
import traceback


def loaded_nccl():
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if "libnccl" in line and "/" in line})


def wheel_nccl():
    from importlib.metadata import PackageNotFoundError, files
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            for f in files(dist) or []:
                if f.name == "libnccl.so.2":
                    return str(f.locate()), dist
        except PackageNotFoundError:
            continue
    return None, None


def timed(fn, iters):
    import torch
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters  # microseconds


def main():
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    torch.cuda.init()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    before = loaded_nccl()
    wheel_path, wheel_dist = wheel_nccl()
    if not before and "T3D_NCCL_LIBRARY" not in os.environ and wheel_path:
        os.environ["T3D_NCCL_LIBRARY"] = wheel_path
    import t3d

    print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name(dev)}")
    print(f"- torch's NCCL: {'.'.join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else 'none'}")
    print(f"- libnccl loaded after CUDA init: {before or 'none'}; wheel {wheel_dist}: {wheel_path}")
    print(f"- T3D_NCCL_LIBRARY: {os.environ.get('T3D_NCCL_LIBRARY', '(unset: t3d loads libnccl.so.2)')}")

    failures = []
    rows = []
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("t3d", init_method=f"file://{d}/store", rank=0, world_size=1)
        info = t3d.build_info()
        print(f"- t3d {info['version']}: cuda={info['cuda']} nccl_version={info['nccl_version']} "
              f"nccl_error={info['nccl_error']} features={info['features']}")
        nccl_pg = None
        if dist.is_nccl_available():
            try:
                nccl_pg = dist.new_group([0], backend="nccl")
            except Exception as e:  # a comparison only
                print(f"- torch's nccl backend at one rank: unavailable ({e!r})")

        def check(name, got, want):
            ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
            if not ok:
                failures.append(name)
                print(f"  FAIL {name}: got {got.flatten()[:4].tolist()} want {want.flatten()[:4].tolist()}")
            return ok

        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            for n in (1024, 1 << 20, 1 << 24):
                base = (torch.arange(n, device=dev) % 251).to(dtype)
                nbytes = base.numel() * base.element_size()
                iters = 50 if n <= (1 << 20) else 10
                cases = []
                # all_reduce: SUM/MAX/AVG of one rank are the input itself; PREMUL_SUM scales it.
                for opname, op in (("SUM", dist.ReduceOp.SUM), ("MAX", dist.ReduceOp.MAX),
                                   ("AVG", dist.ReduceOp.AVG), ("PREMUL_SUM x0.5", None)):
                    if op is None and dtype == torch.int32:
                        continue
                    if op is None:
                        op = dist._make_nccl_premul_sum(0.5)
                        want = base * 0.5
                    else:
                        want = base.clone()
                    if opname == "AVG" and dtype == torch.int32:
                        continue  # NCCL's ncclAvg is for floating types
                    t = base.clone()
                    dist.all_reduce(t, op=op)
                    ok = check(f"all_reduce {opname} {dtype} n={n}", t, want)
                    cases.append((f"all_reduce {opname}", ok, lambda g, t=t, op=op: dist.all_reduce(t, op=op, group=g)))
                t = base.clone()
                dist.broadcast(t, src=0)
                ok = check(f"broadcast {dtype} n={n}", t, base)
                cases.append(("broadcast", ok, lambda g, t=t: dist.broadcast(t, src=0, group=g)))
                out = torch.full_like(base, 7)
                dist.all_gather_into_tensor(out, base)
                ok = check(f"all_gather_into_tensor {dtype} n={n}", out, base)
                cases.append(("all_gather_into_tensor", ok,
                              lambda g, out=out: dist.all_gather_into_tensor(out, base, group=g)))
                out = torch.full_like(base, 7)
                dist.reduce_scatter_tensor(out, base)
                ok = check(f"reduce_scatter_tensor {dtype} n={n}", out, base)
                cases.append(("reduce_scatter_tensor", ok,
                              lambda g, out=out: dist.reduce_scatter_tensor(out, base, group=g)))
                for name, ok, fn in cases:
                    if name.startswith("all_reduce") and name != "all_reduce SUM":
                        continue  # time one reduction per size
                    us = timed(lambda: fn(None), iters)
                    nccl_us = None
                    if nccl_pg is not None:
                        try:
                            nccl_us = timed(lambda: fn(nccl_pg), iters)
                        except Exception as e:
                            print(f"  torch nccl {name}: {e!r}")
                    rows.append((name, str(dtype).replace("torch.", ""), nbytes, ok, us, nccl_us))
        torch.cuda.synchronize()
        after = loaded_nccl()
        dist.destroy_process_group()

    print(f"- libnccl loaded at the end: {after or 'none'}")
    print()
    print("| collective | dtype | bytes | checked | t3d us | t3d GB/s | torch nccl us |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for name, dt, nbytes, ok, us, nus in rows:
        gbs = nbytes / us / 1e3 if us > 0 else float("nan")
        nccl_col = f"{nus:.1f}" if nus is not None else "-"
        print(f"| {name} | {dt} | {nbytes} | {'ok' if ok else 'FAIL'} | {us:.1f} | {gbs:.1f} | {nccl_col} |")
    print()
    if failures:
        print(f"FAILED {len(failures)} check(s): {', '.join(failures)}")
        return 1
    print(f"all checks passed ({len(rows)} timed calls, each result checked first)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
