"""Generated training text (no hub): stories from a small grammar over a byte vocabulary, tokenized to bytes and
packed into fixed-length sequences through `datasets` the way transformers' examples/3D_parallel.py packs TinyStories.
"""

from __future__ import annotations

import random

import torch

# A closed vocabulary with agreement and fixed phrase shapes: a model learns the words within a few dozen steps
# (the loss falls from ln 256 = 5.55 toward ~1.5 nats/byte), and what remains is the grammar's real entropy.
_NAMES = ["Tom", "Lily", "Ben", "Mia", "Sam", "Anna", "the cat", "the dog", "a bird", "the old man"]
_VERBS = ["saw", "liked", "found", "chased", "helped", "made", "lost", "took"]
_THINGS = ["a red ball", "a big box", "the blue kite", "a small cake", "the green frog", "a shiny stone",
           "the little boat", "a warm hat"]
_PLACES = ["in the park", "at home", "by the lake", "under the tree", "on the hill", "in the garden"]
_FEELINGS = ["happy", "sad", "tired", "proud", "scared", "excited"]
_ENDINGS = ["The end.", "They were friends.", "It was a good day.", "Then they went home."]


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(4)
    a, b = rng.choice(_NAMES), rng.choice(_NAMES)
    if kind == 0:
        return f"{a.capitalize()} {rng.choice(_VERBS)} {rng.choice(_THINGS)} {rng.choice(_PLACES)}."
    if kind == 1:
        return f"{a.capitalize()} was {rng.choice(_FEELINGS)} because {b} {rng.choice(_VERBS)} {rng.choice(_THINGS)}."
    if kind == 2:
        n = rng.randrange(1, 6)
        return f"{a.capitalize()} counted: " + ", ".join(str(i) for i in range(1, n + 2)) + "."
    return f"One day, {a} and {b} played {rng.choice(_PLACES)}."


def generate_stories(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    stories = []
    for _ in range(n):
        body = " ".join(_sentence(rng) for _ in range(rng.randrange(2, 6)))
        stories.append(f"{body} {rng.choice(_ENDINGS)}\n")
    return stories


def build_packed_dataset(num_sequences: int, seq_len: int, seed: int, multiple_of: int):
    """A `datasets.Dataset` of `num_sequences` rows {input_ids, labels}, each seq_len long, labels = inputs shifted.

    The row count is cut to a multiple of `multiple_of` (the global batch) so every step sees a full global batch;
    it does not depend on --steps, so runs of different lengths (and resumed runs) read the same data.
    """
    import datasets

    datasets.disable_progress_bars()
    # ~35 bytes a sentence, ~3.5 sentences a story: ask for 20% more text than the packing needs.
    n_stories = int(num_sequences * (seq_len + 1) / 120 * 1.2) + 16
    raw = datasets.Dataset.from_dict({"text": generate_stories(n_stories, seed)})

    def tokenize(batch):
        ids = [list(t.encode("utf-8")) for t in batch["text"]]
        return {"input_ids": ids}

    def pack(batch):
        flat = [tok for ids in batch["input_ids"] for tok in ids]
        n = len(flat) // (seq_len + 1)
        chunks = [flat[i * (seq_len + 1):(i + 1) * (seq_len + 1)] for i in range(n)]
        return {"input_ids": [c[:-1] for c in chunks], "labels": [c[1:] for c in chunks]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
    packed = tokenized.map(pack, batched=True, remove_columns=tokenized.column_names, batch_size=1000)
    keep = min(num_sequences, len(packed)) // multiple_of * multiple_of
    if keep == 0:
        raise ValueError(f"generated data packs into {len(packed)} sequences, fewer than one global batch "
                         f"({multiple_of}); raise --num-sequences")
    return packed.select(range(keep)).shuffle(seed=seed)


def collate(batch):
    return {
        "input_ids": torch.tensor([row["input_ids"] for row in batch], dtype=torch.long),
        "labels": torch.tensor([row["labels"] for row in batch], dtype=torch.long),
    }
