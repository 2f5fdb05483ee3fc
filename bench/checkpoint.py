"""Checkpoints of a training run: what a run needs to go on in a new process.

Nothing that ckpt compiled is in them: a plan is a pure function of the graph
and the config, made again (or read from Inductor's cache) at the first step
of the new process. What is in them: the model's and the optimizer's state,
and the default generator's state, from which Inductor draws its dropout
seeds (``inductor_seeds``, once per step) and eager dropout its masks. The
batches and the learning rate are functions of the step (bench/corpus.py,
bench/training.py), so there is no sampler or scheduler state to keep.
"""
from __future__ import annotations

import dataclasses
import pathlib

import torch

from bench.corpus import Corpus, load_corpus


def save_checkpoint(path: str, mode: str, settings, corpus: Corpus, step: int, model, optimizer) -> None:
    """The state before ``step`` runs: the run's ``mode`` and ``settings``
    (a TrainSettings), the corpus it reads, and the state listed above."""
    torch.save({
        "step": step,
        "mode": mode,
        "settings": dataclasses.asdict(settings),
        "corpus": {"files": corpus.files, "digest": corpus.digest},
        "model": model.state_dict(),  # the module's, not torch.compile's wrapper's (no _orig_mod. prefix)
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
    }, path)


def restore(checkpoint: dict, model, optimizer) -> int:
    """Load a checkpoint's state into a freshly built model and optimizer;
    return the step to go on from."""
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    torch.set_rng_state(checkpoint["rng"])
    return checkpoint["step"]


def checkpoint_corpus(checkpoint: dict) -> Corpus:
    """The corpus a checkpoint's run trained on, read again and checked."""
    corpus = load_corpus([pathlib.Path(f) for f in checkpoint["corpus"]["files"]])
    if corpus.digest != checkpoint["corpus"]["digest"]:
        raise SystemExit(f"the corpus files have changed since the checkpoint (digest {corpus.digest}, "
                         f"was {checkpoint['corpus']['digest']}): the batches would not be the same")
    return corpus
