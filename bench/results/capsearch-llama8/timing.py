"""Interleaved timing of each mode at its largest batch under the 96 MiB cap
(from bench/results/capsearch-llama8), so that machine load hits all alike."""
import statistics, sys, time
import torch
from bench.real import real_case
from bench.modes import parse_mode
from bench.harness import prepare, peak_bytes, fresh_inductor_cache, warm_up_compiler

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 9
case = real_case("llama8")
torch.manual_seed(0)
base = case.build()
plan = [("eager+checkpoint", 5), ("compile", 1), ("compile+budget=0.5", 2), ("ckpt+budget=peak:96MiB", 6)]
with fresh_inductor_cache():
    warm_up_compiler("cpu")
    preps = {}
    for name, batch in plan:
        prep = prepare(case, base, parse_mode(name), batch, "cpu")
        prep.step(); prep.step()
        preps[name] = prep
        print(f"prepared {name} at batch {batch}", flush=True)
    peaks = {}
    for name, batch in plan:
        prep = preps[name]
        prep.step()
        prep.model.zero_grad(set_to_none=True)
        peaks[name] = peak_bytes(prep.step, "cpu") / 2**20
    times = {name: [] for name, _ in plan}
    for r in range(ROUNDS):
        for name, batch in plan:
            t = time.perf_counter(); preps[name].step(); times[name].append(time.perf_counter() - t)
        print(f"round {r} " + " ".join(f"{n}={times[n][-1]:.2f}" for n, _ in plan), flush=True)
import partitioners; print("partitioners from", partitioners.__file__)
ref = "eager+checkpoint"
for name, batch in plan[1:]:
    ratios = [(batch / times[name][i]) / (5 / times[ref][i]) for i in range(ROUNDS)]
    print(f"{name}: tokens/s over eager+checkpoint's, per round: " + " ".join(f"{x:.2f}" for x in ratios) + f"; median {statistics.median(ratios):.2f}")
print("| mode | batch | peak MiB (re-measured) | median step s | tokens/s |")
print("|---|---|---|---|---|")
for name, batch in plan:
    s = statistics.median(times[name])
    print(f"| {name} | {batch} | {peaks[name]:.2f} | {s:.3f} | {batch*512/s:,.0f} |")
