"""The registry of environment variables (c_src/base/params.def): the README's table is the generated one, every
T3D_* variable the sources read is declared, every declared one is read, and t3d.build_info()["params"] /
`python -m t3d` report the values in effect."""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
import subprocess
import sys

import pytest

import _dist

if _dist.is_gloo():
    pytest.skip("t3d's own registry", allow_module_level=True)

import t3d  # noqa: E402
from t3d import _params  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
README = os.path.join(ROOT, "README.md")
# Where t3d reads its environment: the C library, the attention kernels, the torch shim, the Python package.
SOURCE_DIRS = ("c_src", "kernels", "shim", os.path.join("python", "t3d"))
SOURCE_FILES = (os.path.join("python", "t3d_autoload.py"),)
C_EXTS = (".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".def")
ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


# ---- the README ------------------------------------------------------------------------------------------------


def test_readme_table_is_the_generated_one():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    have = _params.readme_table(text)
    want = _params.markdown_table()
    if have != want:
        diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "README.md", "generated"))
        pytest.fail("README.md's environment table is not the one generated from c_src/base/params.def; run "
                    f"`python -m t3d params --update-readme README.md`\n{diff}", pytrace=False)


def test_readme_check_command_fails_on_a_changed_table(tmp_path):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text(text, encoding="utf-8")
    bad.write_text(text.replace("| `T3D_DEBUG` | log level", "| `T3D_DEBUG` | logging level"), encoding="utf-8")
    run = [sys.executable, "-m", "t3d", "params", "--check-readme"]
    assert subprocess.run(run + [str(good)], capture_output=True, timeout=120).returncode == 0
    out = subprocess.run(run + [str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "--update-readme" in out.stderr, out.stderr
    # --update-readme puts the generated table back, touching nothing outside the markers.
    fix = subprocess.run([sys.executable, "-m", "t3d", "params", "--update-readme", str(bad)], capture_output=True,
                         text=True, timeout=120)
    assert fix.returncode == 0, fix.stderr
    assert bad.read_text(encoding="utf-8") == text


# ---- the declarations ------------------------------------------------------------------------------------------


def _size(text: str) -> int | None:
    """The number a shown default starts with ("2 MiB", "65536", "-1 (auto)", "`1`"), or None."""
    m = re.match(r"`?(-?\d+)`?(?: (KiB|MiB))?(?:$| \()", text)
    if m is None:
        return None
    return int(m.group(1)) * {None: 1, "KiB": 1 << 10, "MiB": 1 << 20}[m.group(2)]


def test_declarations_are_complete_and_consistent():
    entries = _params.params()
    names = [p["name"] for p in entries]
    assert len(names) == len(set(names)), names
    for p in entries:
        where = p["name"]
        assert re.fullmatch(r"T3D_[A-Z0-9_]+", p["name"]), where
        assert p["type"] in ("int", "str", "bool"), where
        assert p["reader"] in ("libt3d", "shim", "kernels", "python"), where
        for key in ("meaning", "default_shown"):
            assert p[key] and "\n" not in p[key] and "|" not in p[key], (where, key)
        if p["type"] != "str":
            default = int(p["default"])  # an integer type has an integer default
            shown = _size(p["default_shown"])
            # "2 MiB" must be what the code uses; words ("one half") are the meaning's business.
            assert shown is None or shown == default, (where, p["default_shown"], default)
    # The variables the task of declaring them all named, with the defaults the code had.
    want = {"T3D_SHM_BYTES": "2097152", "T3D_TIMEOUT_MS": "600000", "T3D_INLINE_BYTES": "65536",
            "T3D_INLINE_WAIT_NS": "20000", "T3D_SPIN_NS": "5000", "T3D_YIELD_NS": "2000000",
            "T3D_YIELD_NS_OVERSUBSCRIBED": "200000", "T3D_SHM_ONESHOT_BYTES": "65536", "T3D_SHM_CHUNK_BYTES": "0",
            "T3D_SHM_DIRECT_BYTES": "16384", "T3D_SHM_DIRECT_MAX_BYTES": "4194304", "T3D_SHM_NT_BYTES": "4194304",
            "T3D_SHM_P2P": "1", "T3D_SHM_P2P_EAGER_BYTES": "-1", "T3D_ALGO_SMALL_BYTES": "65536",
            "T3D_TRANSPORT": "auto", "T3D_UCX_ERR_MODE": "none", "T3D_NCCL_LIBRARY": "libnccl.so.2", "T3D_DEBUG": "",
            "T3D_DEBUG_FILE": "", "T3D_CUDA_BLOCKING_WAIT": "0", "T3D_ATTN_ISA": "", "T3D_ATTN_BF16DOT": "0",
            "T3D_AUTOLOAD": "1", "T3D_AUTO_INTEGRATIONS": "1", "T3D_MODEL_CACHE": ""}
    assert {p["name"]: p["default"] for p in entries if p["name"] in want} == want


# ---- who reads the environment: a scan of the sources ----------------------------------------------------------


def _strip_c_comments(src: str) -> str:
    """C or C++ source without its comments; string and character literals kept as they are."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("/*", i):
            j = src.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(" ")
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _balanced(src: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes the one at src[i], skipping string literals."""
    depth, n = 0, len(src)
    while i < n:
        c = src[i]
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            i = j + 1
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _split_args(args: str) -> list[str]:
    parts, depth, cur, i = [], 0, [], 0
    while i < len(args):
        c = args[i]
        if c in "\"'":
            j = i + 1
            while j < len(args) and args[j] != c:
                j += 2 if args[j] == "\\" else 1
            cur.append(args[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur).strip())
    return parts


def _calls(src: str, fn: str):
    """The argument lists of the calls of fn in src."""
    for m in re.finditer(r"\b%s\s*\(" % re.escape(fn), src):
        start = m.end() - 1
        yield _split_args(src[start + 1:_balanced(src, start, "(", ")") - 1])


_FUNC_DEF = re.compile(r"^[A-Za-z_][\w \t\*:&<>,]*?\b([A-Za-z_]\w*)\s*\(([^;{}()]*)\)[^;{}()]*\{", re.M)


def _functions(src: str):
    """(name, parameter names, body) of each function defined at the start of a line."""
    for m in _FUNC_DEF.finditer(src):
        params = [re.findall(r"\w+", p)[-1] for p in m.group(2).split(",") if re.findall(r"\w+", p)]
        body_start = m.end() - 1
        yield m.group(1), params, src[body_start:_balanced(src, body_start, "{", "}")]


def scan_c(sources: dict[str, str]) -> set[str]:
    """Environment variables read in C or C++ sources (path -> text): string literals passed to getenv, to
    t3d_param_find, or to a function that hands one of its parameters on to such a call (t3d__env_int, comm.c's
    budget: found by following the calls, as many levels as there are); plus the ids given to the registry's
    getters (t3d__param_int(T3D_PARAM_X) reads T3D_X)."""
    texts = {path: _strip_c_comments(text) for path, text in sources.items()}
    readers = {"getenv", "secure_getenv", "t3d_param_find"}
    changed = True
    while changed:  # a function that forwards a parameter to a reader is a reader
        changed = False
        for src in texts.values():
            for name, params, body in _functions(src):
                if name in readers:
                    continue
                if any(set(args) & set(params) for r in readers for args in _calls(body, r)):
                    readers.add(name)
                    changed = True
    names = set()
    for src in texts.values():
        for r in readers:
            for args in _calls(src, r):
                names.update(m.group(1) for a in args for m in [re.fullmatch(r'"([A-Z][A-Z0-9_]*)"', a)] if m)
        names.update("T3D_" + m for m in re.findall(r"\bt3d__param_(?:int|str|is_set)\s*\(\s*T3D_PARAM_(\w+)", src))
    return names


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def scan_py(sources: dict[str, str]) -> set[str]:
    """Environment variables read in Python sources: os.environ.get / .pop / [...] (not assignments), os.getenv,
    `"X" in os.environ`, with the name written as a literal."""
    names = set()
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, path)):
            key = None
            if isinstance(node, ast.Call) and node.args:
                f = node.func
                if isinstance(f, ast.Attribute) and f.attr in ("get", "pop") and _is_environ(f.value):
                    key = node.args[0]
                elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (
                        isinstance(f, ast.Name) and f.id == "getenv"):
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
                key = node.slice
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                if _is_environ(node.comparators[0]):
                    key = node.left
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and ENV_NAME.fullmatch(key.value):
                names.add(key.value)
    return names


def _tree_sources() -> tuple[dict[str, str], dict[str, str]]:
    c, py = {}, {}
    paths = [os.path.join(ROOT, f) for f in SOURCE_FILES]
    for d in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, d)):
            dirnames[:] = [x for x in dirnames if x != "__pycache__"]
            paths += [os.path.join(dirpath, f) for f in filenames]
    for path in paths:
        rel = os.path.relpath(path, ROOT)
        if path.endswith(".py"):
            with open(path, encoding="utf-8") as f:
                py[rel] = f.read()
        elif path.endswith(C_EXTS):
            with open(path, encoding="utf-8", errors="replace") as f:
                c[rel] = f.read()
    return c, py


def test_the_scanner_finds_reads_and_only_reads():
    c = {"a.c": r'''
/* getenv("T3D_IN_COMMENT") */
// t3d__env_int("T3D_IN_LINE_COMMENT", 1)
int64_t t3d__env_int(const char *name, int64_t dflt) {
  const char *s = getenv(name);
  return s ? atoll(s) : dflt;
}
static int64_t knob(_Atomic int64_t *slot, const char *env, int64_t dflt) {
  return t3d__env_int(env, dflt);
}
void f(void) {
  knob(&x, "T3D_VIA_TWO_FORWARDERS", 5000);
  if (getenv("T3D_DIRECT") == NULL) puts("T3D_OK");
  printf("%s\n", t3d_result_string(T3D_OK), "T3D_NOT_READ");
  int v = t3d__param_int(T3D_PARAM_BY_ID);
}
''', "b.cpp": 'bool on() { t3d_param_t p; return t3d_param_find("T3D_BY_NAME", &p) == T3D_OK; }\n'}
    assert scan_c(c) == {"T3D_VIA_TWO_FORWARDERS", "T3D_DIRECT", "T3D_BY_ID", "T3D_BY_NAME"}
    py = {"a.py": '''
import os
from os import environ
# os.environ.get("T3D_IN_COMMENT")
"""os.getenv("T3D_IN_DOCSTRING")"""
a = os.environ.get("T3D_A", "1") == "0"
b = os.getenv("T3D_B")
c = os.environ["T3D_C"]
d = "T3D_D" in os.environ
e = environ.get("T3D_E")
os.environ["T3D_WRITTEN"] = "1"
os.environ.setdefault("T3D_DEFAULTED", "1")
env = dict(os.environ, T3D_PASSED_ON="1")
'''}
    assert scan_py(py) == {"T3D_A", "T3D_B", "T3D_C", "T3D_D", "T3D_E"}


def test_every_variable_read_is_declared_and_every_declared_one_is_read():
    c, py = _tree_sources()
    read = scan_c(c) | scan_py(py)
    ours = {n for n in read if n.startswith("T3D_")}
    declared = {p["name"] for p in _params.params()}
    # The scan sees the reads it must (directly, through comm.c's budget(), from Python, from the shim).
    assert {"T3D_SHM_BYTES", "T3D_AUTOLOAD", "T3D_ATTN_ISA", "T3D_CUDA_BLOCKING_WAIT"} <= ours, sorted(ours)
    missing = ours - declared
    assert not missing, (f"read from the environment but not declared in c_src/base/params.def: {sorted(missing)}"
                         " (declare them there, then `python -m t3d params --update-readme README.md`)")
    unread = declared - ours
    assert not unread, f"declared in c_src/base/params.def but read nowhere: {sorted(unread)}"


# ---- the values in effect --------------------------------------------------------------------------------------

_SHOW = "import json, t3d; print(json.dumps({p['name']: p for p in t3d.build_info()['params']}))"


def _params_in_child(**env) -> dict:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("T3D_")}
    child_env.update(env)
    out = subprocess.run([sys.executable, "-c", _SHOW], capture_output=True, text=True, env=child_env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_build_info_params_follow_the_environment():
    unset = _params_in_child()
    p = unset["T3D_SHM_BYTES"]
    assert (p["value"], p["value_text"], p["default"], p["set"], p["env"]) == (2097152, "2097152", "2097152", False,
                                                                             None)
    assert p["reader"] == "libt3d" and p["meaning"]
    assert unset["T3D_TRANSPORT"]["value"] == "auto" and unset["T3D_DEBUG_FILE"]["value"] == ""

    got = _params_in_child(T3D_SHM_BYTES="4194304", T3D_TRANSPORT="shm", T3D_SPIN_NS="5k", T3D_SHM_NT_BYTES="0x100",
                           T3D_INLINE_BYTES="-1", T3D_YIELD_NS="", T3D_CUDA_BLOCKING_WAIT="1")
    p = got["T3D_SHM_BYTES"]
    assert (p["value"], p["set"], p["valid"], p["env"]) == (4194304, True, True, "4194304")
    assert (got["T3D_TRANSPORT"]["value"], got["T3D_TRANSPORT"]["set"]) == ("shm", True)
    # Parsed as t3d__env_int always did: no suffixes (the default holds, but the user did set it), base prefixes.
    assert (got["T3D_SPIN_NS"]["value"], got["T3D_SPIN_NS"]["set"], got["T3D_SPIN_NS"]["valid"]) == (5000, True, False)
    assert got["T3D_SHM_NT_BYTES"]["value"] == 256
    assert got["T3D_INLINE_BYTES"]["value"] == -1
    assert (got["T3D_YIELD_NS"]["value"], got["T3D_YIELD_NS"]["set"]) == (2000000, False)  # empty is unset
    assert got["T3D_CUDA_BLOCKING_WAIT"]["value"] == 1


def test_python_m_t3d_prints_the_values_in_effect():
    env = dict(os.environ, T3D_SHM_BYTES="4194304")
    out = subprocess.run([sys.executable, "-m", "t3d"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith("  T3D_")}
    assert {p["name"] for p in _params.params()} == set(lines), out.stdout
    assert lines["T3D_SHM_BYTES"][1:4] == ["4194304", "libt3d", "set"], lines["T3D_SHM_BYTES"]
    md = subprocess.run([sys.executable, "-m", "t3d", "params", "--markdown"], capture_output=True, text=True,
                        timeout=120)
    assert md.returncode == 0 and md.stdout == _params.markdown_table(), md.stderr


def test_build_info_lists_what_the_extension_lists():
    info = t3d.build_info()
    assert [p["name"] for p in info["params"]] == [p["name"] for p in _params.params()]
    assert set(info["params"][0]) >= {"name", "value", "default", "set", "meaning", "reader"}
