"""The largest batch whose peak step memory fits under a cap: doubling (or
halving) to bracket it, then bisection, within a fixed number of probes."""
from __future__ import annotations

from collections.abc import Callable

RESOLUTION = 8
"""Bisection stops once the bracket is within 1/RESOLUTION of the best batch
(12.5%): each probe is a compile, and finer steps change little."""


def largest_batch_under_cap(
    peak_at: Callable[[int], int],
    cap: int,
    start: int,
    start_peak: int | None,
    max_probes: int,
) -> tuple[int | None, list[tuple[int, int]]]:
    """The largest batch found with ``peak_at(batch) <= cap`` (None if not even
    batch 1 fits, or none was found within the probes), and every probe as
    ``(batch, peak)``. ``start_peak`` is the known peak at ``start``; it costs
    no probe. ``peak_at`` may return None for a failed probe (e.g. out of
    memory), which counts as over the cap."""
    start_fits = start_peak is not None and start_peak <= cap
    fits, over = (start, None) if start_fits else (None, start)
    probes: list[tuple[int, int]] = []
    while len(probes) < max_probes:
        if over is None:
            batch = fits * 2
        elif fits is None:
            batch = over // 2
            if batch < 1:
                break
        else:
            if over - fits <= max(1, fits // RESOLUTION):
                break
            batch = (fits + over) // 2
        peak = peak_at(batch)
        probes.append((batch, peak))
        if peak is not None and peak <= cap:
            fits = batch
        else:
            over = batch
    return fits, probes
