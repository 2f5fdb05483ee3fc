"""A byte-level text corpus every machine has: the Python standard library's
own source, read from disk, no download.

The files are the ``*.py`` modules at the top of the standard library folder,
in sorted order; every tenth file (the 10th, 20th, ...) is the validation
split, the rest the training split. The bytes differ between Python
versions, so ``digest`` identifies the corpus a run used.
"""
from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import sysconfig

import torch

VOCAB = 256
"""Byte values: the model reads and predicts raw bytes."""
VALIDATION_EVERY = 10
"""Every VALIDATION_EVERY-th file goes to the validation split."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: torch.Tensor
    """The training split's bytes, one uint8 tensor."""
    validation: torch.Tensor
    files: tuple[str, ...]
    """The source files, in order."""
    digest: str
    """sha256 of both splits, the first 12 hex digits."""


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's top-level modules, in sorted order."""
    return sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def load_corpus(files: list[pathlib.Path] | None = None) -> Corpus:
    """The corpus of ``files`` (default: stdlib_files()), split by file."""
    files = stdlib_files() if files is None else files
    texts = [path.read_bytes() for path in files]
    validation = b"".join(t for i, t in enumerate(texts, start=1) if i % VALIDATION_EVERY == 0)
    train = b"".join(t for i, t in enumerate(texts, start=1) if i % VALIDATION_EVERY != 0)
    digest = hashlib.sha256(train + b"\0" + validation).hexdigest()[:12]
    return Corpus(_bytes_tensor(train), _bytes_tensor(validation), tuple(map(str, files)), digest)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def windows(data: torch.Tensor, offsets: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape (len(offsets), seq): the bytes at each
    offset and the bytes one further on, as int64 token ids."""
    rows = torch.stack([data[o:o + seq + 1] for o in offsets.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def train_batch(corpus: Corpus, step: int, batch: int, seq: int, seed: int = 0):
    """The training batch of ``step``: random windows drawn from a generator
    seeded by ``(seed, step)`` alone, so a resumed run gets the same batches
    without saving any sampler state, and the default generator (which
    dropout draws from) is never touched."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)  # a prime stride: no two (seed, step) collide for step < 1_000_003
    offsets = torch.randint(len(corpus.train) - seq - 1, (batch,), generator=generator)
    return windows(corpus.train, offsets, seq)


def validation_batches(corpus: Corpus, count: int, batch: int, seq: int):
    """``count`` fixed batches of windows spread evenly over the validation split."""
    offsets = torch.linspace(0, len(corpus.validation) - seq - 1, count * batch).long()
    return [windows(corpus.validation, chunk, seq) for chunk in offsets.split(batch)]
