"""scripts/perf_step_summary.py: perf report lines go to the right groups, and the split into the backend's own cost
and the model's work adds up (the profile itself needs perf and root: scripts/profile-step.sh)."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def pss():
    spec = importlib.util.spec_from_file_location("perf_step_summary",
                                                  os.path.join(ROOT, "scripts", "perf_step_summary.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# perf report --stdio -F overhead,comm,dso,sym, as perf 6.1 prints it.
REPORT = """\
# Overhead  Command          Shared Object          Symbol
# ........  ...............  .....................  ......
#
    40.00%  python3          libpython3.11.so.1.0   [.] _PyEval_EvalFrameDefault
    10.00%  python3          libtorch_cpu.so        [.] c10::impl::OperatorEntry::lookup
     5.00%  python3          libtorch_cpu.so        [.] mkl_blas_def_sgemm_kernel_0_zen
     5.00%  python3          libtorch_python.so     [.] torch::autograd::THPVariable_getitem
     4.00%  python3          libc.so.6              [.] _int_malloc
     3.00%  python3          libt3d.so.0            [.] t3d__shm_wait_line
     2.00%  python3          libtorch_cpu.so        [.] gloo::transport::tcp::Pair::send
     6.00%  gloo_tcp_loop    [kernel.kallsyms]      [k] tcp_sendmsg
     4.00%  t3d_progress     libc.so.6              [.] __memmove_avx_unaligned_erms
     3.00%  python3          [kernel.kallsyms]      [k] do_sched_yield
     2.00%  python3          [kernel.kallsyms]      [k] tcp_poll
     5.00%  python3          [kernel.kallsyms]      [k] do_syscall_64
     4.00%  swapper          [kernel.kallsyms]      [k] pv_native_safe_halt
     1.00%  python3          [kernel.kallsyms]      [k] pv_native_safe_halt
     2.00%  pt_elastic       libpython3.11.so.1.0   [.] _PyEval_EvalFrameDefault
     4.00%  python3          libfoo.so              [.] bar
"""


def test_groups(pss):
    c = pss.shares(REPORT)
    assert sum(c.values()) == pytest.approx(100.0)
    assert set(c) <= set(pss.GROUPS)
    assert dict(c) == pytest.approx({
        "Python interpreter": 40.0,
        "torch C++ (dispatch, autograd, allocation)": 10.0,
        "tensor kernels": 5.0,
        "torch Python bindings": 5.0,
        "libc (malloc, memcpy)": 4.0,
        "backend library": 5.0,  # libt3d, and gloo's code inside libtorch_cpu
        "backend threads": 10.0,  # whatever the backends' own threads run, kernel or libc
        "kernel: scheduling, yields, futexes": 3.0,
        "kernel: networking": 2.0,
        "kernel: other": 5.0,
        "idle cores": 5.0,
        "launcher (t3d-train, torchrun)": 2.0,
        "other": 4.0,
    })


def test_split(pss):
    c = pss.shares(REPORT)
    parts = pss.split(c, step_ms=100.0, cores=2)
    assert parts["per_step"] == pytest.approx(200.0)
    # own: backend threads 10 + library 5 + scheduling 3 + networking 2 = 20% of 200 core-ms
    assert parts["own"] == pytest.approx(40.0)
    # model: interpreter 40 + torch C++ 10 + bindings 5 + kernels 5 = 60% of 200 core-ms, over 2 cores
    assert parts["model"] == pytest.approx(120.0)
    assert parts["bound_ms"] == pytest.approx(60.0)
