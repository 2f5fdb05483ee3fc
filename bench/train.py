"""A real training run: a GPT-style byte model on the standard library's source
(bench/corpus.py), with dropout and AdamW, under several modes side by side.

    python -m bench.train                 # default size, every mode (make train)
    python -m bench.train --quick         # tiny, under a minute
    python -m bench.train --modes compile ckpt --steps 100
    python -m bench.train --stop-at 200 --checkpoint run.pt   # train to step 200, save, exit
    python -m bench.train --resume run.pt --json rest.json    # go on from there in a new process

Every mode builds the same model from the same seed and sees the same batches
(a function of the step, bench/corpus.py). Dropout draws from the default
generator: Inductor through one ``inductor_seeds`` draw per step, eager
through its own draws, so the compiled modes share their masks and eager has
others. Writes results.json, results.md and PNG plots into --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from bench.checkpoint import checkpoint_corpus
from bench.corpus import load_corpus
from bench.modes import parse_modes
from bench.train_results import run_all
from bench.training import DEFAULT_MODES, DEFAULT_OUT, QUICK_MODES, SIZES, Run, TrainSettings, train


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"tiny model, {SIZES['quick'].steps} steps")
    p.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                   help=f"modes of python -m bench (default: {' '.join(DEFAULT_MODES)})")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: per size)")
    p.add_argument("--resume-check", type=int, default=None, metavar="N",
                   help="resume the ckpt modes from step N in a new process and compare "
                        "(default: 50 steps before the end; 0: no check)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this many steps (one mode)")
    p.add_argument("--checkpoint", default=None, help="with --stop-at: save the run here")
    p.add_argument("--resume", default=None, help="go on from this checkpoint (its mode and settings)")
    p.add_argument("--json", default=None, help="with --resume or --stop-at: write the Run here")
    p.add_argument("--reports", default=None, help="write ckpt's reports (with AdamW's state) under this folder")
    p.add_argument("--out", default=DEFAULT_OUT, help="results folder (default: bench/results/train)")
    return p


def _write_run(run: Run, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(run), f)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.resume:
        checkpoint = torch.load(args.resume, weights_only=True)
        settings = TrainSettings.from_dict(checkpoint["settings"])
        (mode,) = parse_modes([checkpoint["mode"]])
        _write_run(train(mode, settings, checkpoint_corpus(checkpoint), resume=checkpoint), args.json)
        return
    corpus = load_corpus()
    settings = SIZES["quick" if args.quick else "default"]
    if args.steps is not None:
        settings = dataclasses.replace(settings, steps=args.steps)
    modes = parse_modes(args.modes or (QUICK_MODES if args.quick else DEFAULT_MODES))
    if args.stop_at is not None:
        if len(modes) != 1:
            raise SystemExit("--stop-at trains one mode: give one with --modes")
        _write_run(train(modes[0], settings, corpus, stop_at=args.stop_at, checkpoint_at=args.stop_at,
                         checkpoint_path=args.checkpoint), args.json)
        return
    args.argv = sys.argv[1:] if argv is None else list(argv)
    run_all(modes, settings, corpus, args)


if __name__ == "__main__":
    main()
