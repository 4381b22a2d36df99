"""The environment variables t3d reads, from libt3d's registry (c_src/base/params.def, listed by t3d_param_get).

`params()` gives them with their values in effect (also `t3d.build_info()["params"]`); `markdown_table()` is the
README's table of environment variables, which sits between the two marker comments below and is rewritten by
`python -m t3d params --update-readme README.md` (tests/python/test_params.py fails when it differs).
"""

from __future__ import annotations

import argparse
import sys

README_BEGIN = "<!-- env-table:begin -->"
README_END = "<!-- env-table:end -->"

# Variables that are not t3d's but that it passes on or looks at: rows of the README's table, not of the registry.
EXTERNAL_ROWS = (
    ("UCX_*", "UCX's own settings (e.g. `UCX_TLS`; t3d excludes `sysv` unless `UCX_TLS` is set)", "UCX's", "UCX"),
)

_KEYS = ("name", "type", "reader", "meaning", "default", "default_shown", "value", "value_text", "env", "set", "valid")


def params(raw: list | None = None) -> list[dict]:
    """One dict per variable, in the registry's order: name, type ("int", "str" or "bool"), reader ("libt3d",
    "shim", "kernels" or "python"), meaning (one line, Markdown), default (the value when unset, as text),
    default_shown (the default as the README shows it), value (in effect: int for int and bool, str for str),
    value_text, env (what the environment held, or None), set (the environment sets it), valid (False when it is set
    to text its type cannot parse, and the default holds).

    libt3d reads the environment once per process, at the first use of the registry; `raw` is the list the
    extension already returned (t3d.build_info passes its own)."""
    if raw is None:
        from . import _C

        raw = _C._params()
    return [{k: p[k] for k in _KEYS} for p in raw]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(entries: list[dict] | None = None) -> str:
    """The README's table: variable, meaning, default, reader; the registry's rows, then EXTERNAL_ROWS. It depends on
    the declarations only, never on the environment."""
    if entries is None:
        entries = params()
    rows = [(f"`{p['name']}`", p["meaning"], p["default_shown"], p["reader"]) for p in entries]
    rows += [(f"`{name}`", meaning, default, reader) for name, meaning, default, reader in EXTERNAL_ROWS]
    lines = ["| variable | meaning | default | read by |", "| --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _markers(text: str) -> tuple[int, int]:
    begin = text.find(README_BEGIN)
    end = text.find(README_END)
    if begin < 0 or end < begin or text.count(README_BEGIN) != 1 or text.count(README_END) != 1:
        raise ValueError(f"expected one {README_BEGIN} and, after it, one {README_END}")
    return begin + len(README_BEGIN), end


def readme_table(text: str) -> str:
    """The table between the markers of a README's text (without the blank lines around it)."""
    begin, end = _markers(text)
    return text[begin:end].strip("\n") + "\n"


def replace_readme_table(text: str, table: str) -> str:
    """The README's text with `table` between its markers (blank lines around it, so that Markdown sees a table
    whatever it makes of the comments)."""
    begin, end = _markers(text)
    return text[:begin] + "\n\n" + table + "\n" + text[end:]


def describe(entries: list[dict] | None = None, meanings: bool = False) -> list[str]:
    """Lines for `python -m t3d`: each variable with its value in effect, who reads it and where that value comes
    from; with `meanings`, each followed by its meaning."""
    if entries is None:
        entries = params()
    width = max(len(p["name"]) for p in entries)
    lines = []
    for p in entries:
        value = p["value_text"] if p["value_text"] != "" else "(none)"
        if not p["set"]:
            origin = "default"
        elif p["valid"]:
            origin = "set"
        else:
            origin = f"set to {p['env']!r}, not an integer: default"
        lines.append(f"{p['name']:<{width}}  {value:<14} {p['reader']:<8} {origin}")
        if meanings:
            lines.append(f"    {p['meaning']} (default: {p['default_shown']})")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m t3d params",
                                 description="The environment variables t3d reads, with their values in effect.")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--markdown", action="store_true", help="print the README's table (Markdown)")
    group.add_argument("--update-readme", metavar="PATH", help="rewrite the table between the markers of PATH")
    group.add_argument("--check-readme", metavar="PATH",
                       help="exit 1 when the table between the markers of PATH is not the generated one")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
    elif args.update_readme or args.check_readme:
        path = args.update_readme or args.check_readme
        with open(path, encoding="utf-8") as f:
            text = f.read()
        table = markdown_table()
        if args.check_readme:
            if readme_table(text) != table:
                print(f"{path}: the environment table differs from the registry; run "
                      f"`python -m t3d params --update-readme {path}`", file=sys.stderr)
                return 1
            return 0
        new = replace_readme_table(text, table)
        if new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
    else:
        print("\n".join(describe(meanings=True)))
    return 0
