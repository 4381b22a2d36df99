"""t3d-bench (also `python -m t3d.bench`): benchmarks as subcommands.

    t3d-bench attention [--quick]     t3d attention ops vs torch SDPA on CPU (docs/benchmarks/attention.md)
    t3d-bench collectives ...         nccl-tests style collectives, backends side by side
    t3d-bench collectives --nproc N   nccl-tests style collectives, t3d vs gloo vs Open MPI (docs/benchmarks/)

Each subcommand lives in its own module exposing add_parser(subparsers) and run(args); add new ones to _COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module (relative to this package) with add_parser(subparsers) and run(args) -> int
_COMMANDS = {
    "attention": ".attention",
    "collectives": ".collectives",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="t3d-bench", description="t3d benchmarks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, modname in _COMMANDS.items():
        mod = importlib.import_module(modname, __name__)
        mod.add_parser(sub)
        modules[name] = mod
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
