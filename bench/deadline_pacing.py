"""Holding a deadline for real: spot workers taken away in a wave, with and without the pacer.

    python bench/deadline_pacing.py [--records 6000] [--seconds-per-record 0.01] [--spot 2] [--paid 4]
                                    [--window 45] [--wave 5 35] [--rounds 3] [--ray]

Local (the default): `batchline run --workers SPOT --spot-trace FILE` with the synthetic
engine, the trace keeping every spot worker for the wave's first seconds, none during the
wave (the runner kills them outright, as a reclaim would) and every one after. Each round
runs the job twice on a new SQLite store: once without a fallback section (no pacer) and once
with `fallback.workers = PAID`; the deadline is a window from the first claim.

With --ray: the same job on a local Ray cluster of three nodes (`ray.cluster_utils`): a
head, a spot node (custom resource `spot`) and an on-demand node (`on_demand`), placed by
`launch ray --spot-resource spot --paid-resource on_demand`; the wave removes the spot node
(its workers die with it, their leases are taken back once proven dead) and adds it back.

For each run it prints whether the deadline was met (seal minus first claim against the
window), records lost and duplicated (from the store: planned records against results and
dead letters, and every result id once), paid worker-seconds (the store's own record), and
the run's hindsight bound: the work (records x seconds per record) less what the spot workers
could have done by the deadline with the wave known (each spot worker's uptime in the window,
less the restart overhead each start paid, measured as the paid workers' launch to first
claim), in worker-seconds. The ratio paid / bound is the pacer's overhead over hindsight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchline.store import open_store
from batchline.store.paid import restart_overhead

SCHEMA = {"type": "object", "properties": {"category": {"enum": ["a", "b"]}}, "required": ["category"]}


def write_job(folder: Path, args: argparse.Namespace, paid: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "in.jsonl").open("w") as f:
        for i in range(args.records):
            f.write(json.dumps({"id": f"r{i:07d}", "text": f"record {i}", "acl": ["g"]}) + "\n")
    (folder / "schema.json").write_text(json.dumps(SCHEMA))
    spec: dict[str, Any] = {
        "name": "paced", "input": {"path": "in.jsonl", "acl_field": "acl"},
        "model": {"engine": "synthetic", "options": {"seconds_per_record": args.seconds_per_record}},
        "prompt": {"text": "Classify.", "version": "v1"}, "output": {"schema": "schema.json"},
        "shards": {"size": 100, "lease_seconds": args.lease, "renew_seconds": 1, "batch_size": 8},
        "deadline": f"{args.window}s"}
    if paid:
        spec["fallback"] = {"workers": args.paid, "cost_per_worker_hour": 3.0, "spot_cost_per_worker_hour": 1.0,
                            "restart_overhead_seconds": args.restart_overhead}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    return folder / "job.yaml"


def trace_file(folder: Path, args: argparse.Namespace) -> Path:
    start, end = args.wave
    path = folder / "spot.trace"
    path.write_text(f"0 {args.spot}\n{start} 0\n{end} {args.spot}\n")
    return path


def figures(store_url: str, version: str, args: argparse.Namespace, run_start: float | None) -> dict[str, Any]:
    """What the store says of the run, and its hindsight bound (`run_start`: when the wave's
    clock started; None: a worker's restart overhead before the first claim, as for a runner,
    whose trace counts from when it started its workers). SQLite's clock is this machine's."""
    store = open_store(store_url, create=False)
    try:
        info = store.job(version)
        status = store.status(version)
        assert info is not None and status.started_at is not None
        ids = list(store.planned_ids(version))
        results = [r.record_id for r in store.iter_results(version)]
        dead = [d.record_id for d in store.iter_dead_letters(version)]
        starts = store.paid_slots(version)
        paid_seconds = store.paid_spend_seconds(version)
        d = restart_overhead(starts) or args.restart_overhead
        sealed = info.sealed_at if info.sealed_at is not None else float("inf")
        taken = status.started_at
        run_start = taken - d if run_start is None else run_start
        # Spot uptime by the deadline, with the wave known: the trace's workers, less d a start.
        deadline = taken + args.window
        wave_start, wave_end = run_start + args.wave[0], run_start + args.wave[1]
        up = max(0.0, min(wave_start, deadline) - taken) + max(0.0, deadline - max(wave_end, taken))
        starts_of_spot = 1 + (1 if wave_end < deadline else 0)
        spot_seconds = args.spot * max(0.0, up - d * starts_of_spot)
        work = args.records * args.seconds_per_record
        return {"met": sealed - status.started_at <= args.window, "seconds_from_first_claim": sealed - status.started_at,
                "lost": len(set(ids) - set(results) - set(dead)), "duplicated": len(results) - len(set(results)),
                "paid_worker_seconds": paid_seconds, "paid_starts": len(starts), "restart_overhead": d,
                "bound_seconds": max(0.0, work - spot_seconds)}
    finally:
        store.close()


def run_local(folder: Path, args: argparse.Namespace, paid: bool) -> dict[str, Any]:
    spec = write_job(folder, args, paid)
    store = f"sqlite:///{folder / 'store.db'}"
    done = subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store, "--workers",
                           str(args.spot), "--spot-trace", str(trace_file(folder, args))],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"run failed: {done.stderr[-2000:]}")
    return figures(store, done.stdout.strip(), args, None)


def run_ray(folder: Path, args: argparse.Namespace, paid: bool) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    from batchline.launch.ray import RayLauncher
    from batchline.plan.planner import plan
    from batchline.spec import load_spec

    spec = write_job(folder, args, paid)
    store_url = f"sqlite:///{folder / 'store.db'}"
    store = open_store(store_url)
    version = plan(load_spec(spec), store).version
    store.close()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    spot_node = cluster.add_node(num_cpus=args.spot, resources={"spot": args.spot})
    cluster.add_node(num_cpus=args.paid, resources={"on_demand": args.paid})
    ray.init(address=cluster.address, namespace="bench-pacing", log_to_driver=False)
    started = time.time()

    launcher = RayLauncher(store_url, version, args.spot, cpus_per_worker=1, poll_seconds=0.2,
                           spot_resource="spot", paid_resource="on_demand" if paid else None, pace_seconds=2.0,
                           max_restarts=10_000)
    # Ray adds and removes nodes only from the main thread, so the launcher runs beside it.
    running = threading.Thread(target=launcher.run, daemon=True)
    running.start()
    try:
        running.join(max(0.0, args.wave[0] - (time.time() - started)))
        if running.is_alive():
            cluster.remove_node(spot_node)  # every spot worker dies with its node
            running.join(max(0.0, args.wave[1] - (time.time() - started)))
            if running.is_alive():
                cluster.add_node(num_cpus=args.spot, resources={"spot": args.spot})
        running.join()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return figures(store_url, version, args, started)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--seconds-per-record", type=float, default=0.01)
    parser.add_argument("--spot", type=int, default=2, help="spot workers")
    parser.add_argument("--paid", type=int, default=4, help="fallback.workers")
    parser.add_argument("--window", type=float, default=45.0, help="the deadline, seconds from the first claim")
    parser.add_argument("--wave", type=float, nargs=2, default=[5.0, 35.0], metavar=("FROM", "TO"),
                        help="seconds from the run's start during which no spot worker is there")
    parser.add_argument("--lease", type=float, default=5.0, help="shards.lease_seconds")
    parser.add_argument("--restart-overhead", type=float, default=2.0,
                        help="fallback.restart_overhead_seconds until measured")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="a local three-node Ray cluster instead of local workers")
    args = parser.parse_args()
    run = run_ray if args.ray else run_local
    rows: dict[str, list[dict[str, Any]]] = {"without the pacer": [], "with the pacer": []}
    for round_no in range(args.rounds):
        for label, paid in (("without the pacer", False), ("with the pacer", True)):
            with tempfile.TemporaryDirectory(prefix="bench-pacing-") as tmp:
                rows[label].append(run(Path(tmp) / f"r{round_no}", args, paid))
            print(json.dumps({"round": round_no, "run": label, **rows[label][-1]}), flush=True)
    where = "a local Ray cluster (head, spot node, on-demand node)" if args.ray else "local workers"
    print(f"\n{args.records:,} records at {args.seconds_per_record * 1000:g} ms on {args.spot} spot workers "
          f"({where}), up to {args.paid} paid; deadline {args.window:g} s from the first claim; no spot worker "
          f"from {args.wave[0]:g} s to {args.wave[1]:g} s; {args.rounds} rounds")
    print(f"{'run':<20}{'met':>8}{'s to seal':>12}{'lost':>6}{'dup':>6}{'paid ws':>10}{'bound ws':>10}{'paid/bound':>12}")
    for label, found in rows.items():
        met = sum(r["met"] for r in found)
        paid = statistics.median(r["paid_worker_seconds"] for r in found)
        bound = statistics.median(r["bound_seconds"] for r in found)
        ratio = statistics.median(r["paid_worker_seconds"] / r["bound_seconds"] for r in found) \
            if all(r["bound_seconds"] > 0 for r in found) else float("nan")
        print(f"{label:<20}{f'{met}/{len(found)}':>8}{statistics.median(r['seconds_from_first_claim'] for r in found):>12.1f}"
              f"{sum(r['lost'] for r in found):>6}{sum(r['duplicated'] for r in found):>6}{paid:>10.1f}{bound:>10.1f}"
              f"{ratio:>12.2f}")
    print("medians over the rounds; lost and dup summed; command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
