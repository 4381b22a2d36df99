# t3d-train on CUDA: the default dp2 x tp2 x cp2 layout (8 ranks) on the GPUs there are (one, on the machines this
# project is lent: its ranks share it, and t3d stages their CUDA tensors through host memory) against one process
# on one GPU: the same global batch per step, so the loss curves agree within float32 reduction-order noise; with
# the ranks' collectives staged through host memory, and on the device path.
# Skips without a GPU.
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 1, reason="no CUDA device on this machine")

STEPS = 5
RTOL = 2e-4  # the GPU's float32 kernels (TF32 off) differ in order from one layout to another
COMMON = ["--device", "cuda", "--steps", str(STEPS), "--global-batch", "8", "--seq-len", "64", "--seed", "0",
          "--no-progress", "--no-plot", "--no-save", "--timeout", "240"]


def _train(tmp_path, name, dp, tp, cp, extra_env=None):
    out = tmp_path / name
    cmd = [sys.executable, "-m", "t3d.train", "--dp", str(dp), "--tp", str(tp), "--cp", str(cp), "--ckpt-dir",
           str(out), "--metrics-json", str(out / "metrics.json"), *COMMON]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               T3D_MODEL_CACHE=str(tmp_path / "models"), **(extra_env or {}))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(out / "metrics.json") as f:
        return [r["loss"] for r in json.load(f)["records"]]


# staged: every collective through host memory; ipc: every one on the device (c_src/cudev/ipc.c). The default
# (auto) mixes the two by size.
PATHS = {"staged": {"T3D_CUDA_PATH": "staged"}, "ipc": {"T3D_CUDA_PATH": "ipc", "T3D_CUDA_IPC_MIN_BYTES": "0"}}


@pytest.mark.parametrize("path", list(PATHS))
def test_dp2_tp2_cp2_on_shared_gpus_matches_one_process(tmp_path, path):
    one = _train(tmp_path, "one", 1, 1, 1)
    eight = _train(tmp_path, "eight", 2, 2, 2, PATHS[path])
    assert len(one) == len(eight) == STEPS
    assert one[-1] < one[0], f"loss did not fall: {one}"
    for i, (g, w) in enumerate(zip(eight, one)):
        assert abs(g - w) <= 1e-5 + RTOL * abs(w), f"step {i + 1}: 8 ranks {g} vs one process {w}\n{eight}\n{one}"
