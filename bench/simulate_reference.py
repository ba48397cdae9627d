"""The interruption simulator's reference table, and how long it takes.

Run: python bench/simulate_reference.py            (the same table as `batchline simulate --compare`)

Prints the reference scenario (2,000,000 items, 20 workers at 18.7 items/s, one
interruption per worker-hour, one in five a stall, 3-minute model load,
10-minute lease, 3 s per shard) for 3 strategies x 3 shard sizes x 5 seeds, first
as the seed design runs it and then as batchline runs it (preemption notices,
take-backs of workers proven dead, tail splitting by the store's rule; no lease
is ever taken over on a silence alone),
the seconds the reference table took, and, because a 5-seed mean moves by about
0.05 h from one set of seeds to another, the long-run mean of the headline cell
over 200 seeds.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

# Runs from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchline.cli.sizing import print_simulation
from batchline.sizing import simulate as sim


def main() -> int:
    seeds = list(sim.REFERENCE_SEEDS)
    started = time.perf_counter()
    seed_rows = sim.sweep(sim.REFERENCE, list(sim.Strategy), sim.REFERENCE_SHARD_SIZES, seeds)
    reference_seconds = time.perf_counter() - started
    batchline = sim.with_batchline(sim.REFERENCE)
    batchline_rows = sim.sweep(batchline, list(sim.Strategy), sim.REFERENCE_SHARD_SIZES, seeds)
    elapsed = time.perf_counter() - started
    print_simulation([(sim.REFERENCE, seed_rows), (batchline, batchline_rows)], None, seeds, elapsed, sys.stdout)
    print(f"reference table (3 strategies x 3 sizes x {len(seeds)} seeds): {reference_seconds:.2f} s")

    print("\nlong-run mean, keyed-per-record, shards of 5,000, seeds 0-199:")
    no_notice = replace(batchline, notice=False)
    for label, scenario in (("seed design", sim.REFERENCE), ("batchline", batchline),
                            ("batchline, no notices", no_notice)):
        runs = [sim.simulate(scenario, sim.Strategy.KEYED_PER_RECORD, 5_000, seed) for seed in range(200)]
        hours = [r.makespan_seconds / 3600 for r in runs]
        lost = {cause: statistics.fmean(getattr(r.lost, cause) for r in runs) / 3600
                for cause in ("reload", "stall", "overhead", "redone", "idle")}
        print(f"  {label:<20} {statistics.fmean(hours):.3f} h (standard error "
              f"{statistics.stdev(hours) / len(hours) ** 0.5:.3f}), "
              f"{statistics.fmean(r.over_ideal for r in runs):.3f}x ideal; GPU-hours lost by cause: "
              + ", ".join(f"{k} {v:.2f}" for k, v in lost.items()))
    print(f"\ncommand: python {shlex.join(sys.argv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
