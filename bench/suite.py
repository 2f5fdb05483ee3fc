"""The side-by-side measurement suite: python -m bench (or make bench).

    python -m bench                              # default suite, CPU, < 15 min on 2 cores
    python -m bench --quick                      # tiny sizes, about 2 minutes
    python -m bench --models gpt --modes compile ckpt ckpt+budget=0.3 --cap 64MiB
    python -m bench --device cuda --preset cuda  # see bench/cuda_check.sh

Writes results.md, results.json and PNG plots into --out (bench/results/).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

from bench import cases, real
from bench.harness import Settings, fresh_inductor_cache, run_case, warm_up_compiler
from bench.modes import DEFAULT_MODES, VALID_FORMS, Mode, ModeError, parse_bytes, parse_modes
from bench.report import machine_info, to_json, to_markdown, write_json

DEFAULT_MODELS = (*cases.BUILTIN, cases.SWEEP)
ALL_MODELS = (*DEFAULT_MODELS, *real.REAL)
# What each preset runs unless --models, --modes, --repeats, --probes say
# otherwise. quick: about 2 minutes on 2 cores, where each CPU compile costs
# 5-30 s, so fewer models and modes and no batch search. cuda-quick: under 8
# minutes on one GPU.
PRESET_DEFAULTS = {
    "quick": {"models": DEFAULT_MODELS, "modes": ("eager", "eager+checkpoint", "compile", "ckpt"),
              "repeats": 3, "probes": 0},
    "default": {"models": DEFAULT_MODELS, "modes": DEFAULT_MODES, "repeats": 5, "probes": 6},
    "cuda": {"models": DEFAULT_MODELS, "modes": DEFAULT_MODES, "repeats": 10, "probes": 6},
    "cuda-quick": {"models": ("gpt", cases.SWEEP), "modes": DEFAULT_MODES, "repeats": 10, "probes": 6},
}
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"modes: {VALID_FORMS}")
    p.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                   help=f"any of {', '.join(ALL_MODELS)}; 'all' for every one, 'real' for the optional "
                        f"transformers/timm ones (default: {' '.join(DEFAULT_MODELS)})")
    p.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                   help=f"default: {' '.join(DEFAULT_MODES)}")
    p.add_argument("--budgets", nargs="+", default=None, metavar="B",
                   help="budget modes compile+budget=B (fractions only) and ckpt+budget=B for each B, "
                        "in place of the budget modes of --modes")
    p.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    p.add_argument("--preset", choices=cases.PRESETS, default=None,
                   help="model sizes and repeats (default: 'default', or 'cuda' with --device cuda)")
    p.add_argument("--quick", action="store_true",
                   help="--preset quick: tiny sizes, few repeats, modes eager eager+checkpoint compile ckpt, "
                        "no batch search")
    p.add_argument("--cuda-quick", action="store_true",
                   help="--device cuda --preset cuda-quick: gpt and a short depth sweep, under 8 minutes on one GPU")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per mode (default: per preset)")
    p.add_argument("--probes", type=int, default=None,
                   help="batch-search probes per mode (default: per preset); 0 turns the search off")
    p.add_argument("--cap", default=None,
                   help="memory cap for the batch search, e.g. 64MiB (default: compile's peak at the default batch)")
    p.add_argument("--depths", type=int, nargs="+", default=None, help="depths of the gpt-depth sweep")
    p.add_argument("--out", default=DEFAULT_OUT, help="results folder (default: bench/results)")
    return p


def _models(names: list[str]) -> list[str]:
    expanded = []
    for name in names:
        group = {"all": ALL_MODELS, "real": tuple(real.REAL)}.get(name, (name,))
        expanded += [n for n in group if n not in expanded]
    unknown = [n for n in expanded if n not in ALL_MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {', '.join(ALL_MODELS)}, all, real")
    return expanded


def _sweep_modes(modes: list[Mode], asked: bool) -> list[Mode]:
    """compile and ckpt, and the ckpt+budget modes when --modes or --budgets
    asked for them (not the preset's: each sweep mode costs a compile per
    depth, a minute or more at depth 16 on 2 cores)."""
    extra = [m for m in modes if m.kind == "ckpt" and m.budget is not None] if asked else []
    return [Mode("compile"), Mode("ckpt"), *extra]


def _modes(args, defaults: dict) -> list[Mode]:
    """--modes (or the preset's), with --budgets in place of their budget modes."""
    texts = list(args.modes or defaults["modes"])
    if args.budgets:
        texts = [t for t in texts if "+budget=" not in t]
        for budget in args.budgets:
            # PyTorch's budget is a fraction only; ckpt also takes bytes.
            if re.fullmatch(r"[0-9.]+", budget) and float(budget) <= 1:
                texts.append(f"compile+budget={budget}")
            texts.append(f"ckpt+budget={budget}")
    try:
        return parse_modes(texts)
    except ModeError as exc:
        raise SystemExit(str(exc)) from None


def _settings(args, defaults: dict) -> Settings:
    try:
        cap = parse_bytes(args.cap) if args.cap else None
    except ValueError as exc:
        raise SystemExit(f"--cap: {exc}") from None
    return Settings(
        device=args.device,
        repeats=args.repeats if args.repeats is not None else defaults["repeats"],
        probes=args.probes if args.probes is not None else defaults["probes"],
        cap=cap,
    )


def _cases(names: list[str], preset: str) -> tuple[list, list[dict]]:
    """The model cases to run, and the real models skipped with the reason."""
    model_cases, skipped = [], []
    for name in names:
        if name == cases.SWEEP:
            continue
        if name not in real.REAL:
            model_cases.append(cases.builtin_case(name, preset))
        elif reason := real.missing(name):
            skipped.append({"model": name, "reason": reason})
            print(f"skipping {name}: {reason}", file=sys.stderr)
        else:
            model_cases.append(real.real_case(name))
    return model_cases, skipped


def run(argv=None) -> dict:
    """Parse ``argv``, run the suite, write the results; return the JSON data."""
    args = parser().parse_args(argv)
    if args.cuda_quick:
        args.device, args.preset = "cuda", "cuda-quick"
    preset = args.preset or ("quick" if args.quick else "cuda" if args.device.startswith("cuda") else "default")
    defaults = PRESET_DEFAULTS[preset]
    modes = _modes(args, defaults)
    names = _models(args.models or list(defaults["models"]))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False here")
    settings = _settings(args, defaults)
    model_cases, skipped = _cases(names, preset)
    sweep_cases = cases.sweep_cases(preset, args.depths) if cases.SWEEP in names else []
    sweep_modes = _sweep_modes(modes, asked=bool(args.modes or args.budgets))

    from tqdm import tqdm

    start = time.perf_counter()
    total = len(model_cases) * len(modes) + len(sweep_cases) * len(sweep_modes)
    with fresh_inductor_cache(), tqdm(total=total, unit="mode", file=sys.stdout) as bar:
        bar.set_postfix_str("warming up the compiler")
        warm_up_compiler(settings.device)
        models, sweep, loads = [], [], []
        for case in model_cases:
            models.append(run_case(case, modes, settings, bar))
            loads.append(os.getloadavg()[0])
        for case in sweep_cases:
            sweep.append(run_case(case, sweep_modes, settings, bar, speed=False, grads=False))
            loads.append(os.getloadavg()[0])
    meta = {
        "machine": machine_info(args.device),
        "settings": {"preset": preset, "modes": [str(m) for m in modes], "models": names,
                     "repeats": settings.repeats, "probes": settings.probes, "cap_bytes": settings.cap,
                     "argv": sys.argv[1:] if argv is None else list(argv)},
        "skipped": skipped,
        "max_load_average": max(loads, default=None),  # 1-minute, sampled after each model
        "elapsed_s": time.perf_counter() - start,
    }
    return write_results(models, sweep, meta, args.out)


def write_results(models, sweep, meta, out: str) -> dict:
    from bench.plots import write_plots

    os.makedirs(out, exist_ok=True)
    data = to_json(models, sweep, meta)
    data["plots"] = [os.path.basename(p) for p in write_plots(models, sweep, out)]
    write_json(os.path.join(out, "results.json"), data)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(to_markdown(models, sweep, meta))
    print(f"wrote {out}/results.md, results.json and {len(data['plots'])} plot(s) "
          f"in {meta['elapsed_s']:.0f} s")
    return data


def main(argv=None) -> None:
    run(argv)
