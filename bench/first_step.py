"""Every step's peak under a peak: cap, the first included (issue 49).

    python -m bench.first_step qwen2 gemma t5 [--layouts per-block graph-broken whole]

For each family (bench/families.py, realistic sizes) and layout: 6 steps at
budget 0.0, every step measured; the cap is 1.1x its settled step peak; then
6 steps under ``peak:<cap>``, every step measured, as a ratio to the cap.
Before the step is known, each graph plans to fit the cap in a step of the
most calls of itself that a plan fits (partitioners/budget.py
``solve_before_the_step``); the step view plans again after step 1.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench import step_budget


def run(family: str, layouts, steps: int = 6) -> list[dict]:
    settings = step_budget.sized(step_budget.Settings(), family)
    settings.steps = settings.measured_steps = steps
    batches = step_budget.fixed_batches(settings, family)
    rows = []
    for layout in layouts:
        tight = step_budget.run_mode(family, layout, "ckpt+budget=0.0", settings, batches)
        cap = int(1.1 * min(tight["peaks"][2:]))  # settled: after the re-plan
        capped = step_budget.run_mode(family, layout, f"ckpt+budget=peak:{cap}", settings, batches)
        rows.append({
            "family": family, "layout": layout, "cap_mib": round(cap / 2**20, 2),
            "budget_0_peaks_mib": [round(p / 2**20, 2) for p in tight["peaks"]],
            "peak_over_cap": [round(p / cap, 3) for p in capped["peaks"]],
            "recompiles": capped["recompiles"],
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="+", choices=step_budget.FAMILIES)
    parser.add_argument("--layouts", nargs="+", default=list(step_budget.LAYOUTS))
    options = parser.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64  # per-block compile: one entry per layer's backend
    for family in options.families:
        run(family, options.layouts)


if __name__ == "__main__":
    main()
