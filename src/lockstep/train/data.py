"""lockstep.train.data: training text, the packed token stream, windows and micro-batches.

A window is the ordered list of whole sequences of one optimizer step (its units). A rank cuts its
share of the window, in order, into micro-batches of at most `micro_batch_tokens` tokens.
"""

from __future__ import annotations

import hashlib
import os

import torch
from torch import Tensor


def read_texts(path: str) -> list[str]:
    """A text file, or every *.txt / *.md file of a folder in sorted order."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".txt", ".md")))
        if not files:
            raise FileNotFoundError(f"data: no .txt or .md files in {path}")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"data: {path!r} does not exist")
    texts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    if not any(t.strip() for t in texts):
        raise ValueError(f"data: {path} holds no text")
    return texts


class PackedDataset:
    """Token stream cut into sequences of `seq_len` tokens, shuffled by seed, epoch by epoch.

    A micro-batch is `micro_batch_tokens // seq_len` sequences; the position (epoch, index) is
    part of the training state."""

    def __init__(self, tokens: list[int], seq_len: int, micro_batch_tokens: int, seed: int):
        if seq_len < 2:
            raise ValueError(f"seq_len: expected >= 2, got {seq_len}")
        if micro_batch_tokens < seq_len:
            raise ValueError(f"micro_batch_tokens: expected >= seq_len ({seq_len}), got {micro_batch_tokens}")
        n = len(tokens) // seq_len
        if n < 1:
            raise ValueError(f"data: {len(tokens)} tokens make no sequence of {seq_len}")
        self.sequences = torch.tensor(tokens[: n * seq_len], dtype=torch.int64).view(n, seq_len)
        self.per_batch = micro_batch_tokens // seq_len
        self.seed = seed
        self.epoch, self.index = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> Tensor:
        return torch.randperm(self.sequences.shape[0], generator=torch.Generator().manual_seed(self.seed * 1000003 + epoch))

    def next_batch(self) -> list[Tensor]:
        """The next micro-batch of `per_batch` sequences."""
        return self.take(self.per_batch)

    def take(self, n: int) -> list[Tensor]:
        """The next `n` sequences."""
        out = []
        for _ in range(n):
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._perm(self.epoch)
            out.append(self.sequences[self._order[self.index]])
            self.index += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def fingerprint(self) -> str:
        """A digest of the sequences and how they are drawn: equal exactly when two datasets give the
        same sequences in the same order (however they are cut into micro-batches)."""
        h = hashlib.sha256(f"{self.seed} {tuple(self.sequences.shape)}".encode())
        h.update(self.sequences.numpy().tobytes())
        return h.hexdigest()[:16]

    def load_state(self, s: dict) -> None:
        self.epoch, self.index = int(s["epoch"]), int(s["index"])
        self._order = self._perm(self.epoch)



def sequences_of(window: list) -> list:
    """A window given as micro-batches (lists) -> its sequences in order."""
    return [s for item in window for s in (item if isinstance(item, (list, tuple)) else [item])]



def micro_batches(sequences: list[Tensor], start: int, stop: int, max_tokens: int) -> list[tuple[int, int]]:
    """Sequences [start, stop) cut in order into runs of at most `max_tokens` tokens (at least one
    sequence each): [(first, stop), ...]."""
    out, first, tokens = [], start, 0
    for i in range(start, stop):
        n = sequences[i].numel()
        if i > first and tokens + n > max_tokens:
            out.append((first, i))
            first, tokens = i, 0
        tokens += n
    if stop > first:
        out.append((first, stop))
    return out

