# Shared pytest setup for the multi-process tests: per-test hard timeouts, the world8 marker, the backend under test.
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _dist  # noqa: E402

DEFAULT_TIMEOUT_S = 300


def pytest_configure(config):
    config.addinivalue_line("markers", "world8: needs 8 ranks (deselect with -m 'not world8')")
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout hard limit")
    config.addinivalue_line("markers", "newest_only: a variation that the oldest stack's run leaves out (its code "
                                       "path is covered there by another test; scripts/test.sh)")


def pytest_report_header(config):
    return f"t3d tests: backend={_dist.BACKEND!r} (T3D_TEST_BACKEND)"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_S))


def pytest_sessionstart(session):
    # Failure tests make the flight recorder dump (on by default, to /tmp/t3d_trace_rank_<rank>): into a folder of
    # this session instead, unless the caller chose one (test_flight_recorder sets its own per test).
    if "TORCH_FR_DUMP_TEMP_FILE" not in os.environ:
        import tempfile

        session.config._t3d_fr_dir = tempfile.TemporaryDirectory(prefix="t3d-test-fr-")
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(session.config._t3d_fr_dir.name, "t3d_trace_rank_")
    if _dist.BACKEND == "t3d":
        # Fail early and once, in the parent, with the import error rather than in every child.
        try:
            import t3d  # noqa: F401
        except Exception as e:  # pragma: no cover - only when the package is broken
            session.config._t3d_import_error = repr(e)


@pytest.fixture(scope="session")
def world_cache():
    """Outcomes of check worlds, shared by all tests of the session (one launch per module and world size)."""
    return {}


@pytest.fixture(autouse=True)
def _t3d_importable(request):
    err = getattr(request.config, "_t3d_import_error", None)
    if err:
        pytest.fail(f"backend t3d selected but 'import t3d' failed: {err}", pytrace=False)
