# scripts/gpu-check.sh on a machine without a GPU: `prepare` makes the kit (GoogleTest's sources) in a temporary
# directory, then the check runs its kit check and its build as on a GPU machine (T3D_WITH_UCX=OFF, GoogleTest from
# the kit, modules staged by `cmake --install` outside the source tree) and must record every GPU step as skipped with
# its reason. The build uses a compiler like the GPU machines' (/opt/gcc: a g++ whose own library directory holds only
# libstdc++.a, so that `-lstdc++` links it statically and -print-file-name finds no libstdc++.so) with
# LDFLAGS=-static-libstdc++, and the staged module must still load the shared libstdc++. To stay short it builds only the library, the CPU kernels and
# the shim (GoogleTest from the kit is configured, not compiled), without the CUDA kernels; the full build, tests
# included, is what the GPU machine runs.
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu-check.sh")
GTEST_SRC = os.environ.get("T3D_GTEST_SRC", "/usr/src/googletest")
GPU_STEPS = ["ctest", "nccl-1rank", "pytest-cuda", "pytest-attention-cuda", "train-cuda", "bench-attention",
             "bench-collectives", "bench-collectives-shared"]


def _modules_in_source_tree():
    pkg = os.path.join(ROOT, "python", "t3d")
    return {f: os.stat(os.path.join(pkg, f)).st_mtime_ns for f in os.listdir(pkg) if ".so" in f}


def _steps(report):
    rows = {}
    for line in report.splitlines():
        m = re.match(r"^\| ([a-z][a-z0-9-]*) \| ([^|]+?) \|", line)
        if m and m.group(1) != "step":
            rows[m.group(1)] = m.group(2)
    return rows


def _static_only_gxx(where):
    """A g++ like the GPU machines' /opt/gcc/bin/g++: its library directory has libstdc++.a and no libstdc++.so."""
    real = shutil.which("g++")
    if real is None:
        pytest.skip("no g++")
    static = subprocess.run([real, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(static):
        pytest.skip("g++ has no libstdc++.a")
    lib = where / "lib"
    lib.mkdir(parents=True)
    os.symlink(static, lib / "libstdc++.a")
    gxx = where / "g++"
    # Its library directory is found from the script's own path, so that every test run's wrapper has the same
    # content (ccache, scripts/ccache-env.sh, knows a compiler by its content: the same one hits its cache).
    gxx.write_text("#!/bin/sh\n"
                   'for a in "$@"; do [ "$a" = -print-file-name=libstdc++.so ] && { echo libstdc++.so; exit 0; }; done\n'
                   f'exec {real} -L"$(dirname "$0")/lib" "$@"\n')
    gxx.chmod(0o755)
    return str(gxx)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.path.isfile(os.path.join(GTEST_SRC, "CMakeLists.txt")),
                    reason=f"no GoogleTest sources in {GTEST_SRC} (Debian: googletest)")
def test_prepare_and_build_without_gpu(tmp_path):
    pytest.importorskip("torch")
    kit, out, build = tmp_path / "kit", tmp_path / "out", tmp_path / "build"
    # T3D_GPU_KIT_WHEELS empty: no wheels for the training demo (a download from PyPI; nothing here needs them).
    r = subprocess.run(["bash", SCRIPT, "prepare", "--kit", str(kit)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "T3D_GPU_KIT_WHEELS": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (kit / "googletest" / "CMakeLists.txt").is_file()
    assert re.search(r"COMMIT=\S+", (kit / "kit.env").read_text())
    assert re.search(r"kit: .* \(\d+\.\d MiB\)", r.stdout) and "carry" in r.stdout, r.stdout

    before = _modules_in_source_tree()
    r = subprocess.run(
        ["bash", SCRIPT, "--no-gpu", "--kit", str(kit), "--out", str(out), "--build-dir", str(build),
         "--python", sys.executable, "--no-cuda-kernels", "--targets", "t3d t3d_kernels t3d_shim",
         "--deadline", "840"],
        capture_output=True, text=True, timeout=870,
        # The GPU machines' gcc links libstdc++ statically unless told otherwise; so does this build: the staged
        # module must still load the shared libstdc++ (the stage step checks it).
        # OMP_NUM_THREADS=1 as scripts/test.sh exports it: the build must still use every core.
        env={**os.environ, "CXX": _static_only_gxx(tmp_path / "gcc"), "LDFLAGS": "-static-libstdc++",
             "OMP_NUM_THREADS": "1"})
    report_path = out / "gpu-check-report.md"
    assert report_path.is_file(), r.stdout[-4000:] + r.stderr[-4000:]
    report = report_path.read_text()
    assert r.returncode == 0, report + r.stderr[-4000:]

    steps = _steps(report)
    assert list(steps) == ["env", "kit", "configure", "build", "stage"] + GPU_STEPS, steps
    for s in ("env", "kit", "configure", "build", "stage"):
        assert steps[s] == "pass", (s, report)
    for s in GPU_STEPS:
        assert steps[s] == "skip: no GPU (--no-gpu given)", (s, report)
    assert report.startswith("# GPU check: PASS")
    assert "mode: **no GPU** (--no-gpu given)" in report
    assert "building without UCX (T3D_WITH_UCX=OFF)" in report
    assert f"building GoogleTest from {kit}/googletest" in report
    assert "ucx=no" in report  # the staged package was imported and says it has no UCX
    # Every core builds, whatever OMP_NUM_THREADS says (1 here, which GNU nproc honours): a -j 1 build made this
    # test the suite's slowest.
    no_omp = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
    cores = int(subprocess.run(["nproc"], env=no_omp, capture_output=True, text=True, check=True).stdout)
    assert f"- machine: {cores} cores," in report, report
    assert re.search(rf"\| build \| pass \| \d+ s \| built t3d t3d_kernels t3d_shim with -j {min(cores, 16)} \|",
                     report), report
    assert re.search(r"_C\.\S+\.so: libstdc\+\+ and torch as resolved \(ldd\):\n```\n(.*\n)*?\s+libstdc\+\+\.so\.6 =>",
                     report), report
    assert (out / "gpu-check-logs.tar.gz").is_file()
    # The build stays in its own directory: nothing is written next to the Python sources.
    assert _modules_in_source_tree() == before
    assert list((build / "site" / "t3d").glob("_C*.so")) and (build / "site" / "t3d" / "libt3d.so.0").is_file()
