"""Port transformers' examples/3D_parallel.py to CPU + t3d by a fixed list of mechanical edits.

    python -m t3d.examples.port_3d_parallel UPSTREAM.py OUT.py    # write the CPU copy (its header lists the edits)
    python -m t3d.examples.port_3d_parallel --diff UPSTREAM.py    # print the unified diff upstream -> CPU copy
    python -m t3d.examples.port_3d_parallel --diff-code UPSTREAM.py   # the same without the added comment header
    python -m t3d.examples.upstream_assets t3d-assets             # the local model/tokenizer/data the copy reads
    DP_SIZE=2 TP_SIZE=2 CP_SIZE=2 NUM_STEPS=3 LR=3e-3 torchrun --standalone --nproc-per-node 8 OUT.py

UPSTREAM.py is the example itself, e.g. from a transformers checkout:
https://github.com/huggingface/transformers/blob/main/examples/3D_parallel.py (Apache-2.0, Copyright 2024 The
HuggingFace Team). Tested against the version at commit 08bdcc14492f1aee5e6b340c18a1f2395e332b9a (sha256 in
UPSTREAM_SHA256). This repository does not ship a copy of it: the edits below are applied to the file you provide,
each one must match exactly once (so a changed upstream fails loudly instead of being half-ported), and the output
is a modified copy that keeps upstream's license header, with a notice stating the changes in front of it.

Every edit and its reason is in EDITS; docs/3d_parallel.md shows the resulting diff.
"""

from __future__ import annotations

import difflib
import hashlib
import sys

UPSTREAM_COMMIT = "08bdcc14492f1aee5e6b340c18a1f2395e332b9a"
UPSTREAM_URL = f"https://github.com/huggingface/transformers/blob/{UPSTREAM_COMMIT}/examples/3D_parallel.py"
# sha256 of the copy of that version the tests ran on (a different one still ports if every edit matches once).
UPSTREAM_SHA256 = "1dee665dc9a7f691530c92a7f401db78b1390d648956ddfbbc2350441198439f"
# Every upstream version the port was checked against: sha256 -> (commit, what changed). The later one only quotes
# the env defaults (os.environ.get("TP_SIZE", "1") for ..., 1): no edit touches those lines, so all twelve edits
# match both and the ported scripts behave the same. Nothing in the example depends on the transformers version
# itself: under transformers 5 its from_pretrained(device_mesh=tp_mesh, tp_plan="auto") would shard over
# WORLD_SIZE ranks, and t3d.hf's loading fix (applied when the first t3d group is created) keeps it on tp_mesh.
KNOWN_UPSTREAM = {
    UPSTREAM_SHA256: (UPSTREAM_COMMIT, "as tested first (transformers 4.57 era)"),
    "6146051e2c29eabdd51efead312e09e3f69934caec376ca653baecc26bf71e6f": ("85e09fef8537d59f861aa672478653d367c62487", "env defaults quoted as strings; otherwise identical"),
}

# (upstream text, replacement, why). Kept as small as the change allows; "t3d:" marks every changed line.
EDITS: list[tuple[str, str, str]] = [
    (
        "import wandb\n",
        "from unittest import mock  # t3d: wandb is not installed; a no-op stand-in (the logger prints each step)\n"
        "wandb = mock.MagicMock()  # t3d\n",
        "imports: wandb is not a dependency here (and runs offline), so `wandb` becomes a no-op stand-in; the "
        "logger still prints every step. Nothing from t3d is imported: creating the first t3d process group enables "
        "t3d's context_parallel handlers for CPU SDPA (torch 2.9's context_parallel knows only the CUDA kernels) "
        "and, transformers being imported already, t3d.hf's fix for from_pretrained(device_mesh=<CPU mesh>, "
        "tp_plan=...), which in transformers 4.57 otherwise fails on every rank with \"Found no NVIDIA driver\" and in "
        "transformers 5 would shard the model over WORLD_SIZE // (dp * pp) ranks instead of tp_mesh's.",
    ),
    (
        "    num_train_steps = 10000  # Number of training steps\n",
        '    num_train_steps = int(os.environ.get("NUM_STEPS", 10000))  # Number of training steps  # t3d: env knob\n',
        "NUM_STEPS (default 10000 as upstream): a test runs 2-3 steps.",
    ),
    (
        "    LR = 1e-5\n",
        '    LR = float(os.environ.get("LR", 1e-5))  # t3d: env knob\n',
        "LR (default 1e-5 as upstream): the local model is tiny and random, its bfloat16 weights (~0.02, spacing "
        "~1e-4) do not move at all under AdamW steps of 1e-5, so the loss cannot fall; tests use LR=3e-3.",
    ),
    (
        '    model_name = "HuggingFaceTB/SmolLM2-1.7B"\n',
        '    model_name = "./t3d-assets/model"  # t3d: local tiny Llama + byte tokenizer (see t3d.examples)\n',
        "local model and tokenizer instead of the hub (offline, seconds per step on CPU).",
    ),
    (
        '        dist.init_process_group("nccl")\n',
        '        dist.init_process_group("t3d")\n',
        "the backend under test.",
    ),
    (
        "        torch.cuda.set_device(local_rank)\n",
        "        # torch.cuda.set_device(local_rank)  # t3d: CPU\n",
        "CPU: there is no CUDA device to select.",
    ),
    (
        'DeviceMesh(device_type="cuda",',
        'DeviceMesh(device_type="cpu",',
        "CPU mesh.",
    ),
    (
        '    device = torch.device(f"cuda:{local_rank}")\n',
        '    device = torch.device("cpu")  # t3d: CPU\n',
        "CPU tensors.",
    ),
    (
        "        model = FSDP(model, device_mesh=dp_mesh, sharding_strategy=ShardingStrategy.NO_SHARD)\n",
        "        model = FSDP(model, device_mesh=dp_mesh, sharding_strategy=ShardingStrategy.NO_SHARD,\n"
        '                     device_id=torch.device("cpu"))  # t3d: FSDP1 needs device_id on CPU\n',
        "FSDP1 without device_id on a CPU-only machine refuses: \"FSDP needs a non-CPU accelerator device\".",
    ),
    (
        '    raw_dataset = load_dataset("roneneldan/TinyStories", split="train[:1%]")',
        '    raw_dataset = load_dataset("./t3d-assets/data", split="train[:1%]")  # t3d: local generated stories',
        "local generated stories instead of the hub's TinyStories (offline); same split expression.",
    ),
    (
        "        num_proc=60,\n",
        "        num_proc=None,  # t3d: was 60\n",
        "packing runs per map shard and drops each shard's tail shorter than seq_len + 1: with 60 shards of a "
        "small local split every shard packs to 0 sequences, the DataLoader is empty and the `while step < "
        "num_train_steps` loop spins forever; it would also fork 60 processes per rank (480 for 8 ranks).",
    ),
    (
        "    if dist.get_rank() == 0:\n        wandb.finish()\n",
        "    if rank == 0:  # t3d: was dist.get_rank(), which raises after destroy_process_group()\n"
        "        wandb.finish()\n",
        "upstream bug on any device: dist.get_rank() after destroy_process_group() raises \"Default process group "
        "has not been initialized\" on every rank, so torchrun reports the finished run as failed.",
    ),
]


def port(upstream: str) -> str:
    """The CPU copy of `upstream` (the example's text): every edit applied exactly once, plus the notice."""
    out = upstream
    for old, new, _ in EDITS:
        n = out.count(old)
        if n != 1:
            raise ValueError(f"upstream 3D_parallel.py does not match: {old.strip()!r} occurs {n} times "
                             f"(expected once; tested against commit {UPSTREAM_COMMIT})")
        out = out.replace(old, new)
    return header(upstream) + out


def header(upstream: str) -> str:
    digest = hashlib.sha256(upstream.encode()).hexdigest()
    lines = [
        "# Modified copy of transformers' examples/3D_parallel.py (Apache License 2.0, Copyright 2024 The HuggingFace",
        "# Team; upstream's license header follows), generated by `python -m t3d.examples.port_3d_parallel` for",
        "# compatibility testing of the t3d backend on CPU. Upstream, as tested:",
        f"# {UPSTREAM_URL}",
        f"# Input sha256: {digest}",
        f"# Input version: upstream commit {KNOWN_UPSTREAM[digest][0]}" if digest in KNOWN_UPSTREAM
        else "# Input version: not one the port was checked against (every edit matched once)",
        "# Changes (each changed line is marked `t3d:`):",
    ]
    for i, (_, _, why) in enumerate(EDITS, 1):
        words, line = why.split(), f"#  {i:2d}. "
        for w in words:
            if len(line) + len(w) > 118:
                lines.append(line.rstrip())
                line = "#      "
            line += w + " "
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def diff(upstream: str, with_header: bool = True) -> str:
    ported = port(upstream)
    if not with_header:
        ported = ported[len(header(upstream)):]
    return "".join(difflib.unified_diff(upstream.splitlines(True), ported.splitlines(True),
                                        "a/examples/3D_parallel.py", "b/examples/3D_parallel.py", n=1))


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] in ("--diff", "--diff-code"):
        with open(argv[1], encoding="utf-8") as f:
            sys.stdout.write(diff(f.read(), with_header=argv[0] == "--diff"))
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        text = port(f.read())
    with open(argv[1], "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
