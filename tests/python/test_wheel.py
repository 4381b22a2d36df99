"""The package as a user gets it: `pip wheel . --no-build-isolation` builds the C library, the kernels and the shim
against this environment's torch (scikit-build-core, pyproject.toml); the wheel goes into a fresh virtualenv that has
torch but not the source tree, and two ranks there run `init_process_group("t3d")` without `import t3d` (torch's
"torch.backends" entry point loads it), an all_reduce, a send/recv and a `torch.ops.t3d.attention` call. pip must not
want to change the installed torch, neither for the wheel nor for `pip install .`.

The fresh venv gets torch without a download: `python -m venv --system-site-packages` would expose the base
interpreter's site-packages, not this venv's, so instead a directory of symlinks to this venv's site-packages
(and torch's, where that is another) entries (all but t3d's own: its editable install, whose entry point would name a module the new venv cannot import,
and pip/setuptools, which the new venv has) is put on the new venv's sys.path by a .pth file. A .pth line that names
a directory only appends it to sys.path: the .pth files inside it (the editable install's) do not run. The directory
lies outside the new venv, so pip there treats what it holds as installed outside the environment and never
uninstalls it (that would delete this venv's files through the links).

Slow (a full build of the native parts, about 3 to 5 minutes on 2 cores) but part of the suite: it is what
`pip install .` does on a user's machine.
"""

import glob
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(900)

# Entries of this venv's site-packages the fresh venv must not see (see the module docstring).
_EXCLUDED = re.compile(r"^(t3d|_t3d|__editable__|_editable_skbc_t3d|pip|setuptools|pkg_resources|_distutils_hack|"
                       r"distutils-precedence|__pycache__)([-_.]|$)", re.IGNORECASE)


def _run(cmd, timeout, cwd, env=None):
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} -> rc {p.returncode}\n{p.stdout[-8000:]}"
    return p.stdout


def _clean_env():
    """The environment of the commands run in the fresh venv: nothing that points Python or pip at this one."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV", "T3D_", "TORCH_DEVICE_BACKEND"))}
    env.update({"OMP_NUM_THREADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _site_dirs():
    """This interpreter's site-packages and the one torch comes from (the same in the project's venv)."""
    import site

    import torch
    dirs = []
    for d in site.getsitepackages() + [os.path.dirname(os.path.dirname(torch.__file__))]:
        if os.path.isdir(d) and os.path.realpath(d) not in map(os.path.realpath, dirs):
            dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # scripts/test.sh builds the oldest stack's wheel once and hands it over (T3D_TEST_WHEEL) instead of a second build.
    given = os.environ.get("T3D_TEST_WHEEL")
    if given:
        assert os.path.isfile(given), f"T3D_TEST_WHEEL={given} is not a file"
        return pathlib.Path(given)
    dist = tmp_path_factory.mktemp("dist")
    # The build runs with this venv's python, so CMake's T3D_PYTHON (scikit-build-core's Python_EXECUTABLE) is it and
    # the shim is built against its torch.
    _run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-build-isolation", "--no-deps", "-w", str(dist)],
         timeout=800, cwd=ROOT)
    wheels = sorted(dist.glob("t3d-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _fresh_venv(tmp):
    """A new venv in tmp whose only packages beyond pip are this venv's, t3d's excepted, through links (above)."""
    links = tmp / "torch-site"
    links.mkdir()
    for site_dir in _site_dirs():
        for name in sorted(os.listdir(site_dir)):
            if not _EXCLUDED.match(name) and not (links / name).exists():
                os.symlink(os.path.join(site_dir, name), links / name)
    venv = tmp / "venv"
    env = _clean_env()
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300, cwd=tmp, env=env)
    py = venv / "bin" / "python"
    venv_site = _run([str(py), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                     timeout=60, cwd=tmp, env=env).strip()
    with open(os.path.join(venv_site, "_t3d_test_torch.pth"), "w") as f:
        f.write(str(links) + "\n")
    # Before the install: torch imports in the new venv, t3d does not.
    out = _run([str(py), "-I", "-c", "import importlib.util, torch; print(torch.__version__, "
                "importlib.util.find_spec('t3d'), importlib.util.find_spec('t3d_autoload'))"],
               timeout=120, cwd=tmp, env=env)
    assert out.split()[1:] == ["None", "None"], out
    return {"tmp": tmp, "py": py, "venv": venv, "site": venv_site, "env": env}


def test_wheel_contents(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    ext = r"\.cpython-[^/]*\.so"
    sources = {os.path.relpath(p, os.path.join(ROOT, "python"))
               for p in glob.glob(os.path.join(ROOT, "python", "t3d", "**", "*.py"), recursive=True)}
    sources.add("t3d_autoload.py")
    assert sources <= names, sorted(sources - names)
    assert "t3d/libt3d.so.0" in names and "t3d/libt3d_kernels.so" in names, sorted(names)
    assert any(re.fullmatch("t3d/_C" + ext, n) for n in names), sorted(names)
    # The CUDA kernels are in the wheel exactly when the developer build of this machine built them (nvcc and a
    # CUDA torch); with no developer build there is nothing to compare against.
    if glob.glob(os.path.join(ROOT, "python", "t3d", "_C*.so")):
        dev_cuda = bool(glob.glob(os.path.join(ROOT, "python", "t3d", "_C_cuda*.so")))
        assert dev_cuda == any(re.fullmatch("t3d/_C_cuda" + ext, n) for n in names), sorted(names)
    # Nothing else: no tests, benchmarks, build files or stale copies from the source tree.
    allowed = re.compile(r"(t3d/.*\.py|t3d_autoload\.py|t3d/_C(_cuda)?" + ext + r"|t3d/libt3d\.so\.0|"
                         r"t3d/libt3d_kernels\.so|t3d-0\.1\.0\.dist-info/[A-Za-z_.]+)")
    assert not [n for n in names if not allowed.fullmatch(n)], sorted(names)
    with zipfile.ZipFile(wheel) as z:
        meta = z.read("t3d-0.1.0.dist-info/METADATA").decode()
        eps = z.read("t3d-0.1.0.dist-info/entry_points.txt").decode()
    assert re.search(r"^Requires-Dist: torch(<2\.16,>=2\.9|>=2\.9,<2\.16)$", meta, re.M), meta[:2000]
    assert re.search(r"^\[torch\.backends\]\s*\nt3d = t3d_autoload:autoload$", eps, re.M), eps
    assert "t3d-train = t3d.train:main" in eps and "t3d-bench = t3d.bench:main" in eps, eps


_SMOKE = textwrap.dedent("""
    import os
    import sys
    from datetime import timedelta

    rank, init_file, venv_site, root = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    assert not [p for p in sys.path if (os.path.realpath(p or ".") + os.sep).startswith(root + os.sep)], sys.path

    import torch
    import torch.distributed as dist

    # No `import t3d`: torch's "torch.backends" entry point (t3d_autoload) has loaded it, from the installed wheel.
    t3d = sys.modules.get("t3d")
    assert t3d is not None, "import torch did not load t3d through its entry point"
    assert os.path.realpath(t3d.__file__).startswith(os.path.realpath(venv_site) + os.sep), t3d.__file__
    assert t3d.build_info()["torch_built"] == torch.__version__, t3d.build_info()

    dist.init_process_group("t3d", init_method="file://" + init_file, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    assert dist.get_backend() == "t3d"
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((1000,), 3.0)), x

    if rank == 0:
        dist.send(torch.arange(10, dtype=torch.int64) * 7, dst=1)
    else:
        y = torch.zeros(10, dtype=torch.int64)
        dist.recv(y, src=0)
        assert torch.equal(y, torch.arange(10, dtype=torch.int64) * 7), y

    torch.manual_seed(rank)
    q, k, v = (torch.randn(2, 4, 33, 16) for _ in range(3))
    out, lse = torch.ops.t3d.attention(q, k, v, True, None, 0, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32

    dist.barrier()
    dist.destroy_process_group()
    print("rank", rank, "ok", t3d.__file__)
""")


def test_two_ranks_in_fresh_venv(wheel, tmp_path):
    e = _fresh_venv(tmp_path)
    _run([str(e["py"]), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], timeout=300,
         cwd=e["tmp"], env=e["env"])
    for script in ("t3d-train", "t3d-bench"):
        assert (e["venv"] / "bin" / script).exists(), script
    run_dir = e["tmp"] / "run"
    run_dir.mkdir()
    (run_dir / "smoke.py").write_text(_SMOKE)
    init_file = run_dir / "pg-init"
    procs = [subprocess.Popen([str(e["py"]), "-I", "smoke.py", str(r), str(init_file), e["site"],
                               os.path.realpath(ROOT)],
                              cwd=run_dir, env=e["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} ok" in out, f"rank {r}: rc {p.returncode}\n{out[-6000:]}"

    # The console scripts run from the installed package too.
    out = _run([str(e["venv"] / "bin" / "t3d-bench"), "--help"], timeout=120, cwd=run_dir, env=e["env"])
    assert "collectives" in out, out

    # The installed t3d's requirements hold (only t3d's lines are judged: the rest of what this venv holds is not
    # this test's business).
    p = subprocess.run([str(e["py"]), "-m", "pip", "check"], cwd=e["tmp"], env=e["env"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    assert not [ln for ln in p.stdout.splitlines() if re.match(r"t3d\b", ln)], p.stdout


def _would_install(e, *args):
    report = e["tmp"] / "report.json"
    _run([str(e["py"]), "-m", "pip", "install", "--dry-run", "--no-index", "--report", str(report), *args],
         timeout=300, cwd=e["tmp"], env=e["env"])
    with open(report) as f:
        return sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in json.load(f)["install"])


def test_pip_keeps_installed_torch(wheel, tmp_path):
    """With its dependencies resolved (no --no-deps), neither the wheel nor `pip install . --no-build-isolation`
    (metadata only, through scikit-build-core, which the new venv sees from this one) would install anything but t3d:
    the installed torch is in the range. --no-index: wanting another torch fails here instead of downloading one."""
    e = _fresh_venv(tmp_path)
    assert _would_install(e, str(wheel)) == [("t3d", "0.1.0")]
    assert _would_install(e, "--no-build-isolation", ROOT) == [("t3d", "0.1.0")]
