# t3d-train end to end: real ranks launched as the CLI launches them (forks of a server that imported the training
# stack once, through torch's elastic launcher), with hard timeouts; test_equivalence's dp2xtp2 case runs under
# torchrun instead (`torchrun -m t3d.train`, the command users type).
# Equivalence: one process and each parallel layout see the same global batch per step, so their loss curves agree
# (rtol 1e-4 over 5 steps; fp32, only the reduction order differs). Resume: a checkpoint written under one layout and
# resumed under another continues the uninterrupted curve. Gloo: refused layouts say why; TP-only runs and matches.
import json
import os
import re
import subprocess
import sys

import pytest

import _dist

STEPS = 5
REF_STEPS = 7  # the reference runs on past STEPS: test_resume_across_layouts continues a 5-step run to 7
RTOL = 1e-4
ATOL = 1e-5
RUN_TIMEOUT_S = 240
COMMON = ["--steps", str(STEPS), "--global-batch", "8", "--seq-len", "64", "--seed", "0", "--no-progress",
          "--no-plot", "--timeout", "120"]

pytestmark = pytest.mark.skipif(_dist.BACKEND != "t3d", reason="t3d-train tests compare against backend t3d")


def _cp_available():
    try:
        import t3d.cp  # noqa: F401
        return None
    except Exception as e:  # noqa: BLE001
        return f"context parallel on CPU needs t3d.cp, which failed to import: {e!r}"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("t3d-models"))


def _run(model_cache, out_dir, dp, tp, cp, extra=(), backend="t3d", expect_rc=0, pp=1, torchrun=False):
    """One t3d-train run: the CLI runs one process itself and launches more (as forks of its preloading server);
    with torchrun, torchrun starts them, as `torchrun -m t3d.train` does."""
    from t3d.train.cli import torchrun_command

    args = ["--pp", str(pp), "--dp", str(dp), "--tp", str(tp), "--cp", str(cp), "--backend", backend,
            "--ckpt-dir", str(out_dir), *COMMON, *extra]
    world = pp * dp * tp * cp
    cmd = torchrun_command(world, args) if torchrun else [sys.executable, "-m", "t3d.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", T3D_MODEL_CACHE=model_cache, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {RUN_TIMEOUT_S}s:\n{(e.stderr or '')[-4000:]}")
    if proc.returncode != expect_rc:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode} (expected {expect_rc}):\n"
                    f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}")
    metrics = None
    path = os.path.join(str(out_dir), "metrics.json")
    if expect_rc == 0:
        with open(path) as f:
            metrics = json.load(f)
    return proc, metrics


def _losses(metrics):
    return [r["loss"] for r in metrics["records"]]


def _assert_norms_close(m, ref, what):
    gn, gn_ref = [r["grad_norm"] for r in m["records"]], [r["grad_norm"] for r in ref["records"]]
    for i, (g, w) in enumerate(zip(gn, gn_ref)):
        assert abs(g - w) <= 1e-3 * w, f"{what}: grad norm at step {i + 1}: {g} vs {w}"


def _assert_close(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} values, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= ATOL + RTOL * abs(w), f"{what}: step {i + 1}: {g} vs {w} (rtol {RTOL})\n{got}\n{want}"


@pytest.fixture(scope="session")
def reference(model_cache, tmp_path_factory):
    """One process, no parallelism: the curve every layout must reproduce (REF_STEPS long: the AdamW learning rate
    is constant, so its first STEPS losses are those of a STEPS-step run). Saves at steps 3 and 6 and at the end."""
    out = tmp_path_factory.mktemp("ref")
    _, m = _run(model_cache, out, 1, 1, 1, extra=["--ckpt-interval", "3", "--steps", str(REF_STEPS)])
    losses = _losses(m)
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    return out, m


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dp,tp,cp,torchrun", [
    (2, 2, 1, True),
    (2, 1, 2, False),
    (1, 2, 2, False),
    pytest.param(2, 2, 2, False, marks=pytest.mark.world8),
], ids=["dp2xtp2", "dp2xcp2", "tp2xcp2", "dp2xtp2xcp2"])
def test_equivalence(reference, model_cache, tmp_path, dp, tp, cp, torchrun):
    if cp > 1 and (why := _cp_available()):
        pytest.skip(why)
    _, ref = reference
    _, m = _run(model_cache, tmp_path, dp, tp, cp, torchrun=torchrun)
    assert m["world"] == dp * tp * cp
    _assert_close(_losses(m), _losses(ref)[:STEPS], f"dp{dp}xtp{tp}xcp{cp} losses")
    _assert_norms_close(m, ref, f"dp{dp}xtp{tp}xcp{cp}")


@pytest.mark.timeout(600)
def test_resume_across_layouts(reference, model_cache, tmp_path):
    """1 process -> dp2xtp2 (FSDP + TP) and dp2xtp2 -> 1 process: both continue the uninterrupted curve."""
    ref_dir, ref = reference
    want = _losses(ref)[3:STEPS]
    # Single-process checkpoint at step 3, resumed on 4 ranks (FSDP NO_SHARD over dp, TP shards).
    _, m = _run(model_cache, tmp_path / "a", 2, 2, 1,
                extra=["--resume", os.path.join(str(ref_dir), "step-000003"), "--ckpt-interval", "3"])
    assert m["start_step"] == 3 and [r["step"] for r in m["records"]] == [4, 5]
    _assert_close(_losses(m), want, "resumed on dp2xtp2")
    assert len(m["losses"]) == STEPS, "the curve keeps the checkpoint's history"
    # That run's final checkpoint (step 5, written by FSDP + TP) restarted on one process for two more steps.
    _, m2 = _run(model_cache, tmp_path / "b", 1, 1, 1,
                 extra=["--resume", str(tmp_path / "a"), "--steps", str(REF_STEPS)])
    _assert_close(_losses(m2), _losses(ref)[STEPS:REF_STEPS], "dp2xtp2 checkpoint resumed on one process")


@pytest.mark.timeout(600)
def test_gloo_tp_only_matches_t3d(reference, model_cache, tmp_path):
    _, ref = reference
    _, m = _run(model_cache, tmp_path, 1, 2, 1, backend="gloo")
    assert m["backend"] == "gloo"
    _assert_close(_losses(m), _losses(ref)[:STEPS], "gloo tp2 losses")


@pytest.mark.timeout(600)
def test_gloo_runs_dp_and_cp_and_matches_t3d(reference, model_cache, tmp_path):
    """gloo averages with ReduceOp.AVG too (floating tensors), and context parallelism runs on CPU for any backend
    through t3d.cp: the dp x cp layout on gloo gives the reference's losses."""
    _, ref = reference
    _, m = _run(model_cache, tmp_path, 2, 1, 2, backend="gloo")
    assert m["backend"] == "gloo"
    _assert_close(_losses(m), _losses(ref)[:STEPS], "gloo dp2xcp2 losses")


@pytest.mark.timeout(600)
def test_compare_backends_table(model_cache, tmp_path):
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "t3d.train", "--compare-backends", "--compare-layouts", "1x2x1,2x1x1",
           "--compare-rounds", "1", "--steps", "2", "--no-progress", "--compare-out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", T3D_MODEL_CACHE=model_cache)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| layout | ranks | backend | step time (ms) | tokens/s | gloo / t3d |" in proc.stdout, proc.stdout
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in proc.stdout.splitlines() if l.startswith("| dp")]
    assert [(r[0], r[2]) for r in rows] == [("dp1xtp2xcp1", "t3d"), ("dp1xtp2xcp1", "gloo"), ("dp2xtp1xcp1", "t3d"),
                                            ("dp2xtp1xcp1", "gloo")], proc.stdout
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) > 0, r  # step time, tokens/s
    for t3d_row, gloo_row in ((rows[0], rows[1]), (rows[2], rows[3])):
        assert t3d_row[5] == "" and abs(float(gloo_row[5]) - float(gloo_row[3]) / float(t3d_row[3])) < 0.02, rows
        assert t3d_row[6] == gloo_row[6], rows  # the same losses on both backends
    # --compare-out: the same table, its rows with every run's step time, and a plot.
    assert (out / "compare-backends.md").read_text().count("| dp") == 4
    saved = json.loads((out / "compare-backends.json").read_text())["rows"]
    assert [(r["layout"], r["backend"]) for r in saved] == [(r[0], r[2]) for r in rows], saved
    for r, row in zip(saved, rows):
        assert f"{r['step_time_s'] * 1000:.1f}" == row[3] and len(r["runs_step_time_s"]) == 1, (r, row)
    assert (out / "compare-backends.png").stat().st_size > 1000


@pytest.mark.timeout(600)
def test_profile_says_where_the_step_goes(model_cache, tmp_path):
    proc, _ = _run(model_cache, tmp_path, 1, 2, 1, extra=["--profile", "2"])
    out = proc.stdout + proc.stderr
    # The CLI launched the two ranks itself, as forks of its server.
    assert "t3d-train: launching 2 ranks (torch elastic launcher; each rank a fork of a server" in out, out
    m = re.search(r"profile, rank 0, 2 step\(s\) after the first: ([\d.]+) ms per step = compute ([\d.]+) ms \(\d+%\), "
                  r"communication ([\d.]+) ms \(\d+%\), DTensor/FSDP machinery ([\d.]+) ms \(\d+%\), Python and the "
                  r"rest ([\d.]+) ms \(\d+%\)\n  largest self times per step: ", out)
    assert m, out[-3000:]
    total, *parts = (float(x) for x in m.groups())
    assert abs(sum(parts) - total) <= 0.2 + 0.01 * total, m.group(0)  # the parts add up to the step
    assert parts[1] > 0, "tp2 all-reduces activations: communication cannot be zero"


def test_cli_rejects_bad_layout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "t3d.train", "--dp", "2", "--tp", "1", "--cp", "1", "--nproc", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "dp*tp*cp" in proc.stderr


# 4D: pipeline stages (torch.distributed.pipelining) and FSDP2 / HSDP beside TP and CP. Every layout and schedule
# must reproduce the one-process curve: losses within RTOL and the grad norm (over every stage and shard, clipped at
# 1.0 in each step) within 1e-3. Three steps: each one clips, so a wrong norm shows in the losses that follow too.
STEPS_4D = 3


def _check_pipeline_summary(m, pp, schedule):
    """The per-stage timing the summary promises: one entry per pipeline rank, its stages, and parts that are
    measured (positive) and fit inside the step."""
    s = m["summary"]
    assert s["schedule"] == schedule and s["microbatches"] >= 1, s
    stages = s["pipeline"]
    assert [t["pp_rank"] for t in stages] == list(range(pp)), stages
    for t in stages:
        assert t["fwd"] > 0 and t["bwd"] > 0 and t["wait"] >= 0 and t["reduce"] > 0 and t["optim"] > 0, t
        assert t["fwd"] + t["bwd"] + t["wait"] + t["reduce"] + t["optim"] <= t["step"] * 1.05 + 1e-3, t
    per_rank = 2 if schedule == "interleaved-1f1b" else 1
    assert sorted(i for t in stages for i in t["stages"]) == list(range(pp * per_rank)), stages


LAYOUTS_4D = [
    # (pp, dp, tp, cp, extra)
    pytest.param(2, 2, 1, 1, ["--schedule", "gpipe"], id="pp2xdp2-gpipe", marks=pytest.mark.newest_only),
    pytest.param(2, 1, 2, 1, ["--schedule", "1f1b"], id="pp2xtp2-1f1b", marks=pytest.mark.newest_only),
    pytest.param(2, 2, 1, 1, ["--schedule", "interleaved-1f1b"], id="pp2xdp2-interleaved"),
    pytest.param(1, 4, 1, 1, ["--dp-shard", "4"], id="fsdp2-dp4", marks=pytest.mark.newest_only),
    pytest.param(1, 4, 1, 1, ["--dp-shard", "2", "--grad-reduce", "premul_sum"], id="hsdp2x2-premul"),
    pytest.param(2, 2, 2, 1, ["--dp-shard", "2", "--schedule", "interleaved-1f1b"], id="pp2xfsdp2xtp2-interleaved",
                 marks=[pytest.mark.world8, pytest.mark.newest_only]),
    pytest.param(2, 1, 2, 2, ["--schedule", "1f1b"], id="pp2xtp2xcp2-1f1b",
                 marks=[pytest.mark.world8, pytest.mark.newest_only]),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pp,dp,tp,cp,extra", LAYOUTS_4D)
def test_4d_equivalence(reference, model_cache, tmp_path, pp, dp, tp, cp, extra):
    if cp > 1 and (why := _cp_available()):
        pytest.skip(why)
    _, ref = reference
    _, m = _run(model_cache, tmp_path, dp, tp, cp, pp=pp, extra=["--steps", str(STEPS_4D), "--no-save", *extra])
    what = f"{m['layout']} {' '.join(extra)}"
    assert m["world"] == pp * dp * tp * cp
    _assert_close(_losses(m), _losses(ref)[:STEPS_4D], f"{what} losses")
    _assert_norms_close(m, ref, what)
    if pp > 1:
        _check_pipeline_summary(m, pp, extra[extra.index("--schedule") + 1])


@pytest.mark.newest_only
@pytest.mark.timeout(600)
def test_resume_pp4_as_pp2xdp2_and_as_hsdp(reference, model_cache, tmp_path):
    """A pp4 run (embeddings, layer 0, layer 1, head: one stage each) checkpointed at step 3 resumes as pp2 x dp2,
    and as HSDP (FSDP2 replicate 2 x shard 2, no pipeline), and both continue the one-process curve: DCP matches
    the stages' global parameter names, and the optimizer state, whatever shards it."""
    _, ref = reference
    _, m = _run(model_cache, tmp_path / "pp4", 1, 1, 1, pp=4, extra=["--ckpt-interval", "3"])
    _assert_close(_losses(m), _losses(ref)[:STEPS], "pp4 losses")
    step3 = str(tmp_path / "pp4" / "step-000003")
    for name, pp, dp, extra in (("pp2xdp2", 2, 2, []), ("hsdp2x2", 1, 4, ["--dp-shard", "2"])):
        _, m2 = _run(model_cache, tmp_path / name, dp, 1, 1, pp=pp, extra=["--resume", step3, "--no-save", *extra])
        assert m2["start_step"] == 3 and [r["step"] for r in m2["records"]] == [4, 5], name
        _assert_close(_losses(m2), _losses(ref)[3:STEPS], f"pp4 checkpoint resumed on {name}")
        _assert_norms_close({"records": m2["records"]}, {"records": ref["records"][3:STEPS]}, f"resumed on {name}")


@pytest.mark.newest_only
@pytest.mark.timeout(600)
def test_compare_schedules_table(model_cache):
    cmd = [sys.executable, "-m", "t3d.train", "--pp", "2", "--dp", "1", "--tp", "1", "--cp", "1",
           "--compare-schedules", "--compare-rounds", "1", "--steps", "2", "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1", T3D_MODEL_CACHE=model_cache)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| schedule | microbatches | step time (ms) | tokens/s | per pipeline rank: compute / wait (ms) |" \
        in proc.stdout, proc.stdout
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in proc.stdout.splitlines()
            if l.startswith("| gpipe") or l.startswith("| 1f1b") or l.startswith("| interleaved")]
    assert [r[0] for r in rows] == ["gpipe", "1f1b", "interleaved-1f1b"], proc.stdout
    for r in rows:
        assert r[1] == "4" and float(r[2]) > 0 and float(r[3]) > 0, r
        ranks = [tuple(float(x) for x in part.split("/")) for part in r[4].split(",")]
        assert len(ranks) == 2 and all(c > 0 and w >= 0 for c, w in ranks), r
    assert len({r[5] for r in rows}) == 1, rows  # every schedule trains the same curve


@pytest.mark.parametrize("args,why", [
    (["--pp", "2", "--microbatches", "3"], "--microbatches 3 must divide the per-replica batch 8"),
    (["--pp", "4", "--schedule", "interleaved-1f1b"], "8 pipeline stages but the model has only 4 units"),
    (["--pp", "2", "--stages-per-rank", "2"], "--stages-per-rank 2 needs --schedule interleaved-1f1b"),
    (["--pp", "4", "--microbatches", "2"], "--schedule 1f1b needs --microbatches >= pp (2 < 4)"),
    (["--dp", "4", "--dp-shard", "3"], "--dp-shard 3 must divide --dp 4"),
], ids=["microbatches", "stages", "stages-per-rank", "1f1b-fill", "dp-shard"])
def test_cli_rejects_bad_4d_layout(args, why, capsys):
    from t3d.train.cli import main

    base = {"--pp": "1", "--dp": "1", "--tp": "1", "--cp": "1"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    rc = main([x for kv in base.items() for x in kv])  # refused before any rank is launched
    err = capsys.readouterr().err
    assert rc == 2 and f"t3d-train: {why}" in err, err


def test_stage_split():
    from t3d.train.pipeline import describe, split_units

    assert describe(split_units(2, 2)) == "stage 0: embed, layer 0; stage 1: layer 1, norm+head"
    assert describe(split_units(2, 4)) == "stage 0: embed; stage 1: layer 0; stage 2: layer 1; stage 3: norm+head"
    assert describe(split_units(4, 4)) == ("stage 0: embed, layer 0; stage 1: layer 1, layer 2; stage 2: layer 3; "
                                           "stage 3: norm+head")
    assert describe(split_units(6, 3)) == ("stage 0: embed, layer 0, layer 1; stage 1: layer 2, layer 3, layer 4; "
                                           "stage 2: layer 5, norm+head")
    with pytest.raises(ValueError, match="5 pipeline stages but the model has only 4 units"):
        split_units(2, 5)
