"""Holding a deadline for real: spot workers taken away, or never there, and the pacer buying.

    python bench/deadline_pacing.py [--scenarios wave none-window none-absolute staircase load-wave]
                                    [--stores sqlite postgres] [--ray] [--records 12000]
                                    [--seconds-per-record 0.01] [--spot 2] [--paid 4] [--window 90]
                                    [--lease 2] [--rounds 1]

Each run is `batchline run --workers SPOT --spot-trace FILE` with the synthetic engine on a new
store (a SQLite file, or a new database on the PostgreSQL at 127.0.0.1:5432), the spec's
`fallback.workers = PAID`; the trace says how many spot workers there are at each moment from
the run's start (the runner kills the extra ones outright, as a reclaim would):

- wave: every spot worker, none from 5 s to 70 s, every one again after;
- none-window / none-absolute: no spot worker at any time (the night a launch took the fleet),
  the deadline a window from the run start, or an absolute time set when the run is launched;
- staircase: the spot workers leave one by one (every 8 s from 8 s), then half of them (at
  least one) come back at 60 s;
- load-wave: every worker takes 3 s to load its model, and the spot workers are reclaimed at 2 s,
  while loading (nothing computed), until 70 s.

(Those moments are for the default 90 s window, and scale with --window.)

With --ray the wave also runs on a local Ray cluster of three nodes (`ray.cluster_utils`: a head,
a spot node and an on-demand node, `launch ray --spot-resource spot --paid-resource on_demand`),
the wave removing the spot node and adding it back.

For each run it prints whether the deadline was met, measured from the run start the store
records (`open_run`), not the first claim; records lost and duplicated, counted from what can go
wrong: the planned ids against the result and dead-letter ids (a planned id with neither is lost;
an id answered twice, or both answered and dead-lettered, is duplicated; an answer for an id never
planned counts too); the paid worker-seconds (the store's own record); and the run's hindsight
bound: the work (records x seconds per record) less what the spot workers could have done by the
deadline with the trace known (each spot worker's uptime in the window, less the restart overhead
each of its starts paid, measured as the paid workers' launch to first claim), in worker-seconds.
The ratio paid / bound is the pacer's overhead over hindsight.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stores import new_store

from batchline.sizing.paced import Trace
from batchline.store import open_store
from batchline.store.paid import restart_overhead

SCHEMA = {"type": "object", "properties": {"category": {"enum": ["a", "b"]}}, "required": ["category"]}
SCENARIOS = ("wave", "none-window", "none-absolute", "staircase", "load-wave")
LOAD_SECONDS = 3.0


def trace_points(scenario: str, spot: int, window: float) -> list[tuple[float, int]]:
    """The scenario's spot workers over time, its moments a share of the window (at 90 s:
    the wave from 5 s to 70 s, the staircase a step every 8 s and half back at 60 s)."""
    at = window / 90.0
    if scenario == "wave":
        return [(0.0, spot), (5.0 * at, 0), (70.0 * at, spot)]
    if scenario.startswith("none"):
        return [(0.0, 0)]
    if scenario == "staircase":
        return [(8.0 * at * i, spot - i) for i in range(spot + 1)] + [(60.0 * at, max(1, spot // 2))]
    if scenario == "load-wave":
        return [(0.0, spot), (2.0, 0), (70.0 * at, spot)]
    raise SystemExit(f"unknown scenario {scenario!r}: one of {', '.join(SCENARIOS)}")


def write_job(folder: Path, args: argparse.Namespace, scenario: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "in.jsonl").open("w") as f:
        for i in range(args.records):
            f.write(json.dumps({"id": f"r{i:07d}", "text": f"record {i}", "acl": ["g"]}) + "\n")
    (folder / "schema.json").write_text(json.dumps(SCHEMA))
    options: dict[str, Any] = {"seconds_per_record": args.seconds_per_record}
    if scenario == "load-wave":
        options["load_seconds"] = LOAD_SECONDS
    # An absolute deadline is set as the run is launched: the window from now.
    deadline = (datetime.fromtimestamp(time.time() + args.window, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                if scenario == "none-absolute" else f"{args.window:g}s")
    spec: dict[str, Any] = {
        "name": "paced", "input": {"path": "in.jsonl", "acl_field": "acl"},
        "model": {"engine": "synthetic", "options": options},
        "prompt": {"text": "Classify.", "version": "v1"}, "output": {"schema": "schema.json"},
        "shards": {"size": 100, "lease_seconds": args.lease, "renew_seconds": 1, "batch_size": 8},
        "deadline": deadline,
        "fallback": {"workers": args.paid, "cost_per_worker_hour": 3.0, "spot_cost_per_worker_hour": 1.0,
                     "restart_overhead_seconds": args.restart_overhead}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    points = trace_points(scenario, args.spot, args.window)
    (folder / "spot.trace").write_text("".join(f"{t:g} {n}\n" for t, n in points))
    return folder / "job.yaml"


def spot_uptime(trace: Trace, workers: int, start: float, end: float, overhead: float) -> float:
    """Productive spot worker-seconds in [start, end] with the trace known: each spot worker's
    up intervals, less the restart overhead each of its starts pays."""
    points = [(start + t, n) for t, n in trace.points]
    total = 0.0
    for i in range(workers):
        up_since: float | None = None
        for t, n in [*points, (end, -1)]:
            t = min(max(t, start), end)
            if n > i and up_since is None:
                up_since = t
            elif n <= i and up_since is not None:
                total += max(0.0, t - up_since - overhead)
                up_since = None
    return total


def figures(store_url: str, version: str, args: argparse.Namespace, trace: Trace) -> dict[str, Any]:
    """What the store says of the run, and its hindsight bound."""
    from batchline.spec import stored_spec

    store = open_store(store_url, create=False)
    try:
        info = store.job(version)
        status = store.status(version)
        assert info is not None and status.run_start is not None
        spec = stored_spec(info)
        assert spec.deadline is not None
        planned = set(store.planned_ids(version))
        answered = collections.Counter(r.record_id for r in store.iter_results(version))
        answered.update(d.record_id for d in store.iter_dead_letters(version))
        starts = store.paid_slots(version)
        d = restart_overhead(starts) or args.restart_overhead
        sealed = info.sealed_at if info.sealed_at is not None else float("inf")
        deadline = spec.deadline.resolve(status.run_start, status.now)
        work = args.records * args.seconds_per_record
        spot = spot_uptime(trace, args.spot, status.run_start, deadline, d)
        return {"met": sealed <= deadline, "spare_seconds": deadline - sealed,
                "lost": len(planned - set(answered)),
                "duplicated": sum(n - 1 for n in answered.values() if n > 1) + len(set(answered) - planned),
                "paid_worker_seconds": store.paid_spend_seconds(version), "paid_starts": len(starts),
                "restart_overhead": d, "bound_seconds": max(0.0, work - spot)}
    finally:
        store.close()


def run_local(folder: Path, args: argparse.Namespace, scenario: str, kind: str) -> dict[str, Any]:
    spec = write_job(folder, args, scenario)
    trace = Trace.read(folder / "spot.trace")
    with new_store(kind, folder, "bench_pacing") as store:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store, "--workers",
                               str(args.spot), "--spot-trace", str(folder / "spot.trace")],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"{scenario} on {kind}: run failed: {done.stderr[-2000:]}")
        return {**figures(store, done.stdout.strip(), args, trace), "wall_seconds": time.monotonic() - started}


def run_ray(folder: Path, args: argparse.Namespace, scenario: str, kind: str) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    from batchline.launch.ray import RayLauncher
    from batchline.plan.planner import plan
    from batchline.spec import load_spec

    if scenario != "wave":
        raise SystemExit("--ray runs the wave only")
    spec = write_job(folder, args, scenario)
    points = trace_points(scenario, args.spot, args.window)
    wave_from, wave_to = points[1][0], points[2][0]
    with new_store(kind, folder, "bench_pacing") as store_url:
        store = open_store(store_url)
        version = plan(load_spec(spec), store).version
        store.close()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        spot_node = cluster.add_node(num_cpus=args.spot, resources={"spot": args.spot})
        cluster.add_node(num_cpus=args.paid, resources={"on_demand": args.paid})
        ray.init(address=cluster.address, namespace="bench-pacing", log_to_driver=False)
        started = time.monotonic()
        launcher = RayLauncher(store_url, version, args.spot, cpus_per_worker=1, poll_seconds=0.2,
                               spot_resource="spot", paid_resource="on_demand", pace_seconds=2.0,
                               max_restarts=10_000)
        # Ray adds and removes nodes only from the main thread, so the launcher runs beside it.
        running = threading.Thread(target=launcher.run, daemon=True)
        running.start()
        try:
            running.join(max(0.0, wave_from - (time.monotonic() - started)))
            if running.is_alive():
                cluster.remove_node(spot_node)  # every spot worker dies with its node
                running.join(max(0.0, wave_to - (time.monotonic() - started)))
                if running.is_alive():
                    cluster.add_node(num_cpus=args.spot, resources={"spot": args.spot})
            running.join()
        finally:
            ray.shutdown()
            cluster.shutdown()
        return {**figures(store_url, version, args, Trace(tuple(points))),
                "wall_seconds": time.monotonic() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--stores", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--ray", action="store_true", help="also the wave on a local three-node Ray cluster")
    parser.add_argument("--records", type=int, default=12000)
    parser.add_argument("--seconds-per-record", type=float, default=0.01)
    parser.add_argument("--spot", type=int, default=2, help="spot workers")
    parser.add_argument("--paid", type=int, default=4, help="fallback.workers")
    parser.add_argument("--window", type=float, default=90.0, help="the deadline, seconds from the run start")
    parser.add_argument("--lease", type=float, default=2.0, help="shards.lease_seconds")
    parser.add_argument("--restart-overhead", type=float, default=2.0,
                        help="fallback.restart_overhead_seconds until measured")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    plans = [(s, k, "local", run_local) for s in args.scenarios for k in args.stores]
    if args.ray and "wave" in args.scenarios:
        plans += [("wave", k, "ray", run_ray) for k in args.stores]
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for scenario, kind, launcher, run in plans:
        for round_no in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="bench-pacing-") as tmp:
                found = run(Path(tmp) / f"r{round_no}", args, scenario, kind)
            rows.setdefault((scenario, kind, launcher), []).append(found)
            print(json.dumps({"scenario": scenario, "store": kind, "launcher": launcher, "round": round_no,
                              **found}), flush=True)
    print(f"\n{args.records:,} records at {args.seconds_per_record * 1000:g} ms ({args.records * args.seconds_per_record:g}"
          f" worker-seconds), {args.spot} spot workers at most, up to {args.paid} paid; deadline {args.window:g} s "
          f"from the run start; {args.rounds} round(s) each")
    print(f"{'scenario':<15}{'store':<10}{'launcher':<9}{'met':>6}{'spare s':>9}{'lost':>6}{'dup':>5}"
          f"{'paid ws':>9}{'bound ws':>10}{'paid/bound':>12}")
    for (scenario, kind, launcher), found in rows.items():
        met = sum(r["met"] for r in found)
        paid = statistics.median(r["paid_worker_seconds"] for r in found)
        bound = statistics.median(r["bound_seconds"] for r in found)
        ratio = statistics.median(r["paid_worker_seconds"] / r["bound_seconds"] for r in found) \
            if all(r["bound_seconds"] > 0 for r in found) else float("nan")
        print(f"{scenario:<15}{kind:<10}{launcher:<9}{f'{met}/{len(found)}':>6}"
              f"{statistics.median(r['spare_seconds'] for r in found):>9.1f}{sum(r['lost'] for r in found):>6}"
              f"{sum(r['duplicated'] for r in found):>5}{paid:>9.1f}{bound:>10.1f}{ratio:>12.2f}")
    print("medians over the rounds; lost and dup summed; command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
