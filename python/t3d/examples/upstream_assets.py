"""Local stand-ins for the hub assets of transformers' examples/3D_parallel.py, so it can run offline.

    python -m t3d.examples.upstream_assets DIR      # writes DIR/model and DIR/data (idempotent), prints DIR

DIR/model: a tiny Llama (t3d-train's TINY_LLAMA config with max_position_embeddings raised to the example's
seq_len of 1024) saved with save_pretrained in float32, plus a byte-level tokenizer (256 tokens, one per byte,
no merges, no special tokens) saved as a PreTrainedTokenizerFast, so `AutoTokenizer.from_pretrained(DIR/model)` and
`AutoModelForCausalLM.from_pretrained(DIR/model, ...)` work as they do for a hub name.

DIR/data/train.jsonl: rows {"text": ...} of generated stories (t3d-train's grammar), each row a little over 1024
bytes, so `load_dataset(DIR/data, split="train[:1%]")` reads it with datasets' json builder and the example's
tokenize/pack code turns every row of that 1% into one packed sequence of 1024 tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

MODEL_OVERRIDES = dict(max_position_embeddings=2048)
ROWS = 4000          # 1% = 40 rows = 40 packed sequences of 1024 = 5 global batches of 8
ROW_BYTES = 1100     # > seq_len: the example truncates each row to 1024 tokens
SEED = 0
VERSION = 1          # bump when the assets change


def _write_model(path: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from t3d.train.model import TINY_LLAMA

    cpu_rng = torch.random.get_rng_state()
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **MODEL_OVERRIDES}))
    torch.random.set_rng_state(cpu_rng)
    model.save_pretrained(path)

    # Byte-level BPE without merges: token i is byte i (in GPT-2's printable byte alphabet), vocab 256 = the model's.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {}
    # GPT-2's bytes_to_unicode order: printable bytes map to themselves, the rest to 256+n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    n = 0
    for b in range(256):
        if b in printable:
            byte_to_char[b] = chr(b)
        else:
            byte_to_char[b] = chr(256 + n)
            n += 1
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 20)
    fast.save_pretrained(path)


def _write_data(path: str) -> None:
    import random

    from t3d.train.data import generate_stories

    rng = random.Random(SEED)
    os.makedirs(path, exist_ok=True)
    stories = iter(generate_stories(ROWS * ROW_BYTES // 100, SEED))
    with open(os.path.join(path, "train.jsonl"), "w", encoding="utf-8") as f:
        for _ in range(ROWS):
            text = ""
            while len(text) < ROW_BYTES:
                try:
                    text += next(stories)
                except StopIteration:
                    stories = iter(generate_stories(ROWS, rng.randrange(1 << 30)))
            f.write(json.dumps({"text": text}) + "\n")


def ensure(root: str) -> str:
    """Create root/model and root/data unless a complete copy is there; safe against concurrent callers."""
    root = os.path.abspath(root)
    stamp = os.path.join(root, "assets.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f).get("version") == VERSION:
                return root
    os.makedirs(os.path.dirname(root), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(root) + ".tmp-", dir=os.path.dirname(root))
    try:
        _write_model(os.path.join(tmp, "model"))
        _write_data(os.path.join(tmp, "data"))
        with open(os.path.join(tmp, "assets.json"), "w") as f:
            json.dump({"version": VERSION}, f)
        if os.path.exists(root):
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.rename(tmp, root)
        except OSError:  # a concurrent caller won
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m t3d.examples.upstream_assets DIR")
    print(ensure(sys.argv[1]))
