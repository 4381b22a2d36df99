"""What a t3d build says about itself (t3d.build_info(), `python -m t3d`), and that a build without UCX
(T3D_WITH_UCX=OFF) serves a same-host group through torch and refuses a configuration that needs UCX at group
creation, with an error that says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import _dist

if _dist.is_gloo():
    pytest.skip("t3d's own build facts", allow_module_level=True)

import torch  # noqa: E402

import t3d  # noqa: E402


def test_build_info_says_what_was_compiled_in():
    info = t3d.build_info()
    features = info["features"]
    assert isinstance(info["ucx"], bool)
    assert set(features) >= {"ucx", "shm", "nccl", "sanitize"}, features
    assert (features["ucx"] != "no") == info["ucx"], info
    assert (info["ucx_version"] is not None) == info["ucx"], info
    assert features["shm"] == "yes"
    assert info["version"] == t3d.__version__
    assert info["torch_runtime"] == torch.__version__
    assert info["torch_built"], info


def test_python_m_t3d_reports_versions_features_and_transports():
    out = subprocess.run([sys.executable, "-m", "t3d"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    info = t3d.build_info()
    assert f"t3d {t3d.__version__}" in text, text
    assert f"python {sys.version.split()[0]}" in text, text
    assert f"torch {torch.__version__}" in text, text
    assert f"built against torch {info['torch_built']}" in text, text
    assert f"ucx={info['features']['ucx']}" in text, text
    transports = text.split("transports usable now:\n", 1)[1]
    usable = {line.split("  ")[1].strip(): line for line in transports.splitlines() if line.startswith("  ")}
    assert set(usable) == {"ucx", "shared memory", "cross-memory attach", "nccl"}, text
    assert (" yes " in usable["ucx"]) == info["ucx"], usable["ucx"]
    assert " yes " in usable["shared memory"], usable["shared memory"]


def _collective_and_p2p(rank, world):
    import torch.distributed as dist

    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    y = torch.arange(4, dtype=torch.float32) + 10 * rank
    if rank == 0:
        dist.send(y, dst=1)
        got = None
    else:
        got = torch.empty(4)
        dist.recv(got, src=0)
        got = got.tolist()
    return x[0].item(), got, t3d.transport()


def test_same_host_two_ranks_collective_and_send_recv():
    results = _dist.run_world(_collective_and_p2p, 2, timeout=120)
    assert [r[0] for r in results] == [3.0, 3.0]
    assert results[1][1] == [0.0, 1.0, 2.0, 3.0]
    want = "shm+ucx" if t3d.build_info()["ucx"] else "shm"
    assert [r[2] for r in results] == [want, want]


def test_without_ucx_transport_ucx_fails_at_group_creation(monkeypatch):
    if t3d.build_info()["ucx"]:
        pytest.skip("this build has UCX (T3D_WITH_UCX=OFF builds only)")
    monkeypatch.setenv("T3D_TRANSPORT", "ucx")
    with pytest.raises(_dist.WorldFailure) as exc:
        _dist.run_world(_collective_and_p2p, 2, timeout=60)
    text = str(exc.value)
    assert "this build of t3d has no UCX" in text, text
    assert "which rank 0 of group" in text and "which rank 1 of group" in text, text
    assert "its transport is 'ucx'" in text, text
