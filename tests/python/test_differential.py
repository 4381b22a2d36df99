# Differential test: seeded random sequences of torch.distributed calls run on t3d and on gloo in the same processes,
# every output compared element by element (difftest.py has the generator, the runner, the comparison and the tables
# of known differences and t3d bugs). A mismatch prints the seed, the call, the spec, both results and a one-line
# reproducer (python tests/python/difftest.py --seed S --world N --calls M).
import json
import os

import pytest

import _dist
import difftest

CALLS = 150
# Two seeds per world size, one world per size (starting a world costs more than running a seed).
SEEDS = {2: [101, 102], 3: [201, 202], 4: [301, 302]}
WORLD_TIMEOUT_S = 240.0   # hard limit for the calls of one world (startup comes on top)
IDLE_S = 75.0             # no call may take longer (the longest legitimate wait, a polled work, gives up at 20 s)

needs_t3d = pytest.mark.skipif(_dist.BACKEND != "t3d", reason="compares t3d with gloo: runs with backend t3d only")

_worlds = {}


def _world(ws):
    """Runs the seeds of a world size once; later tests read the result."""
    if ws not in _worlds:
        try:
            _worlds[ws] = ("ok", difftest.run_world_seeds(ws, SEEDS[ws], calls=CALLS, timeout=WORLD_TIMEOUT_S,
                                                          idle=IDLE_S))
        except _dist.WorldFailure as e:
            _worlds[ws] = ("fail", str(e))
    return _worlds[ws]


@needs_t3d
@pytest.mark.timeout(420)
@pytest.mark.parametrize("ws,seed", [(ws, s) for ws, ss in SEEDS.items() for s in ss],
                         ids=[f"ws{ws}-seed{s}" for ws, ss in SEEDS.items() for s in ss])
def test_differential(ws, seed):
    status, res = _world(ws)
    if status == "fail":
        pytest.fail(f"the world of {ws} ranks running seeds {SEEDS[ws]} ({CALLS} calls each) hung or crashed; the "
                    f"call each rank was in is named below (with the first mismatch it had seen, if any).\n"
                    f"reproduce: python tests/python/difftest.py --seed <seed in the label> --world {ws} "
                    f"--calls {CALLS}\n{res}", pytrace=False)
    e = res.get(seed)
    if e is None:
        pytest.fail(f"seed {seed} did not run: an earlier seed of this world had mismatches "
                    f"(see that seed's test)", pytrace=False)
    if e["mismatches"]:
        pytest.fail(difftest.format_mismatches(e), pytrace=False)
    assert e["calls"] == CALLS, f"seed {seed}: only {e['calls']} of {CALLS} calls ran"


@needs_t3d
@pytest.mark.timeout(200)
def test_harness_reports_a_wrong_result():
    """The harness can fail: t3d's first floating-point result on rank 0 is altered after the call, and the report
    must name that call, on that rank, with a reproducer."""
    res = difftest.run_world_seeds(2, [7], calls=30, timeout=120.0, idle=IDLE_S, inject="first")
    e = res[7]
    assert e["injected_at"] is not None, "nothing to alter in the first 30 calls of seed 7"
    assert e["mismatches"], f"the altered result of call {e['injected_at']} went unnoticed"
    first = e["mismatches"][0]
    assert str(first["sub_call"]) == str(e["injected_at"]) and first["rank"] == 0, first
    text = difftest.format_mismatches(e)
    assert "reproduce: python tests/python/difftest.py --seed 7 --world 2" in text, text


def test_generator_is_deterministic_and_covers_every_kind():
    """Pure Python: the same seed gives the same printable specs, and the fixed seeds reach every kind of call."""
    seen = set()
    for ws, seeds in SEEDS.items():
        for seed in seeds:
            a = difftest.generate(seed, ws, CALLS)
            b = difftest.generate(seed, ws, CALLS)
            assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), (ws, seed)
            sub, specs = a
            assert sub == sorted(set(sub)) and sub and all(0 <= r < ws for r in sub)
            for s in specs:
                difftest.short(s)
                seen.add(s["kind"])
                for c in s.get("calls", []):
                    seen.add(c["kind"])
    missing = (set(difftest.GEN) | {"async_batch"}) - seen
    assert not missing, f"the fixed seeds never generate {sorted(missing)}"


def test_tables_are_well_formed():
    names = [k.name for k in difftest.KNOWN_DIFFERENCES] + [b.name for b in difftest.T3D_BUGS]
    assert len(names) == len(set(names)), names
    for k in difftest.KNOWN_DIFFERENCES:
        assert k.differs and k.reason and callable(k.when), k.name
        assert k.check in ("reference", "gloo_or_reference", "both_raise", "gloo_with"), k.name
        assert k.check == "gloo_with" or k.gloo in ("raises", "skip"), k.name
    for b in difftest.T3D_BUGS:
        assert b.what and b.reproducer and callable(b.when), b.name


def test_docs_list_every_known_difference():
    """docs/architecture.md's table of gloo differences names every KNOWN_DIFFERENCES entry, and no other."""
    import re
    import difftest
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "architecture.md")) as f:
        doc = f.read()
    table = doc[doc.index("| entry | difference | why |"):]
    table = table[:table.index("\n\n")]
    documented = set(re.findall(r"`((?:gloo|t3d|default)-[a-z0-9-]+)`", table))
    known = {k.name for k in difftest.KNOWN_DIFFERENCES}
    assert documented == known, f"only in the docs: {documented - known}; only in the test: {known - documented}"
