"""The deadline rule on real spot availability traces: nightly windows cut from nine AWS zones.

    python bench/deadline_traces.py [--traces ../shared/data/spot-traces] [--window-hours 8]
                                    [--every-hours 24] [--deadline-hours 8] [--spot 16] [--rate 18.7]
                                    [--work-hours 6] [--paid 16] [--paid-price 3] [--processes 2]

Each trace is the availability of one V100 spot instance probed every 195 s for 45 days (the
public traces of "Can't Be Late", Wu et al., NSDI 2024: see the folder's README); a point of 1
is the job's every spot worker, 0 none (a zone with capacity or without: the correlated case).
From each trace's start, an 8 h window every 24 h is one night: the simulator
(`batchline.sizing.paced`, with batchline's notices, take-backs and tail splits, the same rule
every launcher's pacer runs, measuring the rate rather than being handed it) runs the job on
that night under each policy: `none`, `always`, `greedy` and `uniform` (batchline's).

The job is sized so that 16 spot workers at 18.7 records a second would take 6 h; the deadline
is 8 h from the run start; up to 16 paid workers at 3 times the spot price; a decision a minute;
a worker's model load (the restart overhead) 180 s; shards of 5,000. For each policy: the
nights whose deadline it met, the paid worker-hours and cost summed over every night, and its
paid worker-hours against each night's hindsight bound (the work the spot workers could not
do by the deadline, the trace known; the mean of the per-night ratio where the bound is above
zero, and the ratio of the sums). A night that cannot finish (no spot, no paid worker) is a
missed deadline, never an error: the table counts those too.

Without the traces (a checkout with no ../shared/data) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchline.sizing.paced import Pacing, Trace, simulate_paced
from batchline.sizing.pacing import Policy
from batchline.sizing.simulate import Scenario, with_batchline

DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "spot-traces"


def nights(path: Path, args: argparse.Namespace) -> list[tuple[str, float, Trace]]:
    """Every window of the trace: (zone, start offset, the trace from it)."""
    raw = json.loads(path.read_text())
    span = len(raw["data"]) * float(raw["metadata"]["gap_seconds"])
    out = []
    start = 0.0
    while start + args.window_hours * 3600 <= span:
        out.append((path.stem, start, Trace.read(path, workers=args.spot, start_seconds=start)))
        start += args.every_hours * 3600
    return out


def one_night(job: tuple[str, float, Trace, dict[str, Any]]) -> dict[str, Any]:
    zone, start, trace, p = job
    scenario = with_batchline(Scenario(items=p["items"], workers=p["spot"], records_per_second=p["rate"],
                                       interruptions_per_hour=0.0))
    deadline = p["deadline_hours"] * 3600
    bound_run = simulate_paced(scenario, Pacing(deadline, p["paid"], Policy.NONE, 60.0, trace), 5000)
    row: dict[str, Any] = {"zone": zone, "start_hours": start / 3600, "bound_seconds": bound_run.bound_seconds,
                           "spot_up": sum(1 for _t, n in trace.points if n) > 0}
    for policy in Policy:
        r = bound_run if policy is Policy.NONE else simulate_paced(
            scenario, Pacing(deadline, p["paid"], policy, 60.0, trace), 5000, bound_seconds=bound_run.bound_seconds)
        row[str(policy)] = {"met": r.met, "finished": r.finished, "paid_seconds": r.paid_seconds,
                            "makespan_hours": r.makespan_seconds / 3600 if r.finished else None,
                            "lost": r.missing_rows, "duplicated": r.duplicate_rows}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--window-hours", type=float, default=8.0)
    parser.add_argument("--every-hours", type=float, default=24.0)
    parser.add_argument("--deadline-hours", type=float, default=8.0)
    parser.add_argument("--spot", type=int, default=16)
    parser.add_argument("--rate", type=float, default=18.7, help="records a second of one worker")
    parser.add_argument("--work-hours", type=float, default=6.0, help="the job takes this long on every spot worker")
    parser.add_argument("--paid", type=int, default=16)
    parser.add_argument("--paid-price", type=float, default=3.0, help="a paid worker-hour, in spot worker-hours")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write every night's figures here")
    args = parser.parse_args()
    files = sorted(args.traces.glob("*.json")) if args.traces.is_dir() else []
    if not files:
        print(f"no spot traces at {args.traces} (../shared/data/spot-traces in a project checkout): nothing measured")
        return 0
    params = {"items": round(args.spot * args.rate * args.work_hours * 3600), "spot": args.spot, "rate": args.rate,
              "deadline_hours": args.deadline_hours, "paid": args.paid}
    jobs = [(zone, start, trace, params) for path in files for zone, start, trace in nights(path, args)]
    started = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(args.processes) as pool:
        rows = pool.map(one_night, jobs, chunksize=4)
    elapsed = time.perf_counter() - started
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"{len(files)} zones, {len(rows)} nights ({args.window_hours:g} h every {args.every_hours:g} h from each "
          f"trace's start); {params['items']:,} records, {args.spot} spot workers at {args.rate:g} records/s "
          f"({args.work_hours:g} h on every one), deadline {args.deadline_hours:g} h, up to {args.paid} paid at "
          f"{args.paid_price:g}x the spot price; simulated in {elapsed:.0f} s")
    print(f"{'policy':<9}{'met':>10}{'not finished':>14}{'paid w-h':>11}{'paid cost':>11}{'mean over bound':>17}"
          f"{'sum over bound':>16}{'lost':>6}{'dup':>5}")
    bound_hours = sum(r["bound_seconds"] for r in rows) / 3600
    summary: dict[str, dict[str, float]] = {}
    for policy in Policy:
        key = str(policy)
        paid_hours = sum(r[key]["paid_seconds"] for r in rows) / 3600
        ratios = [r[key]["paid_seconds"] / r["bound_seconds"] for r in rows if r["bound_seconds"] > 0]
        mean_ratio = statistics.fmean(ratios) if ratios and policy is not Policy.NONE else math.nan
        met = sum(r[key]["met"] for r in rows)
        summary[key] = {"met": met, "paid_hours": paid_hours}
        print(f"{key:<9}{f'{met}/{len(rows)}':>10}"
              f"{sum(not r[key]['finished'] for r in rows):>14}{paid_hours:>11.1f}{paid_hours * args.paid_price:>11.1f}"
              f"{mean_ratio:>17.2f}{(paid_hours / bound_hours if bound_hours else math.nan):>16.2f}"
              f"{sum(r[key]['lost'] for r in rows):>6}{sum(r[key]['duplicated'] for r in rows):>5}")
    met_always = {(r["zone"], r["start_hours"]) for r in rows if r["always"]["met"]}
    met_uniform = {(r["zone"], r["start_hours"]) for r in rows if r["uniform"]["met"]}
    missed = sorted(met_always - met_uniform)
    print(f"hindsight bound: {bound_hours:.1f} paid worker-hours summed over the nights")
    print(f"uniform meets every deadline always meets: {not missed}" + (f" (misses {missed})" if missed else ""))
    greedy = summary["greedy"]["paid_hours"]
    print(f"uniform's paid cost / greedy's: {summary['uniform']['paid_hours'] / greedy:.3f}" if greedy else
          "greedy bought nothing")
    per_zone: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        per_zone.setdefault(r["zone"], []).append(r)
    print(f"\n{'zone':<22}{'nights':>7}{'no spot':>9}{'uniform met':>13}{'greedy met':>12}{'uniform/greedy':>16}")
    for zone, found in sorted(per_zone.items()):
        u = sum(r["uniform"]["paid_seconds"] for r in found)
        g = sum(r["greedy"]["paid_seconds"] for r in found)
        print(f"{zone:<22}{len(found):>7}{sum(not r['spot_up'] for r in found):>9}"
              f"{sum(r['uniform']['met'] for r in found):>13}{sum(r['greedy']['met'] for r in found):>12}"
              f"{(u / g if g else math.nan):>16.2f}")
    print("command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
