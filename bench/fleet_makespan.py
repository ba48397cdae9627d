"""A real fleet against the interruption simulator: makespan over ideal, with and without tail splitting.

    python bench/fleet_makespan.py [--records 3000] [--workers 4] [--seconds-per-record 0.02]
                                   [--interruptions-per-hour 120] [--stall-share 0.3] [--seed 1]

The simulator's scenario scaled down to this machine: `batchline worker` processes
on the synthetic engine (a set time per record, a 1 s model load), killed (`kill -9`,
a lost machine: a replacement starts at once) and stalled (`SIGSTOP` for the lease
and a second more, then `SIGCONT`) at random, by one seeded schedule shared by both
runs. The only difference between the runs is `shards.tail_split` (not part of the
job version, so each run has a store of its own). A killed worker's lease is taken
back by the next worker that proves it dead (same host, its pid gone); a stalled
one is alive and keeps its lease until it runs out, though its unstarted tail may
be split off.

Beside each run, the simulator's mean over 50 seeds for the same scenario (its
model load is the measured start-up of a worker, and its per-shard overhead the
measured time from a claim to the first result). Wall-clock figures on a shared
2-core machine are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchline.ops.drill.run import children  # noqa: E402
from batchline.plan.planner import plan  # noqa: E402
from batchline.sizing import simulate as sim  # noqa: E402
from batchline.spec import load_spec  # noqa: E402
from batchline.store import Store, open_store  # noqa: E402

LOAD_SECONDS = 1.0
LEASE_SECONDS = 8.0
RENEW_SECONDS = 1.0
SHARD = 250
BATCH = 8


@dataclass(frozen=True)
class Interruption:
    at: float
    slot: int
    stall: bool


def schedule(workers: int, per_hour: float, stall_share: float, horizon: float, seed: int) -> list[Interruption]:
    rng = random.Random(seed)
    out: list[Interruption] = []
    for slot in range(workers):
        t = 0.0
        while True:
            t += rng.expovariate(per_hour / 3600.0)
            if t > horizon:
                break
            out.append(Interruption(t, slot, rng.random() < stall_share))
    return sorted(out, key=lambda i: i.at)


def write_job(folder: Path, records: int, seconds_per_record: float, tail_split: bool) -> Path:
    with (folder / "input.jsonl").open("w") as f:
        for i in range(records):
            f.write(f'{{"id": "r{i:06d}", "text": "record {i} about topic {i % 7}"}}\n')
    (folder / "schema.json").write_text('{"type": "object", "properties": {"category": {"enum": ["a", "b"]}}, '
                                        '"required": ["category"]}')
    spec = {"name": "fleet-makespan", "input": {"path": "input.jsonl"},
            "model": {"engine": "synthetic", "options": {"seconds_per_record": seconds_per_record,
                                                         "load_seconds": LOAD_SECONDS}},
            "prompt": {"text": "Classify.\n", "version": "v1"}, "output": {"schema": "schema.json"},
            "shards": {"size": SHARD, "lease_seconds": LEASE_SECONDS, "renew_seconds": RENEW_SECONDS,
                       "batch_size": BATCH, "grace_seconds": 2, "tail_split": tail_split}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class Fleet:
    def __init__(self, url: str, version: str, workers: int, logs: Path) -> None:
        self.url, self.version, self.logs = url, version, logs
        self.slots: list[subprocess.Popen[bytes] | None] = [None] * workers
        self.stalled_until: dict[int, float] = {}
        self.starts = 0

    def start(self, slot: int) -> None:
        self.starts += 1
        log = (self.logs / f"worker-{self.starts:03d}.log").open("ab")
        self.slots[slot] = subprocess.Popen(
            [sys.executable, "-m", "batchline", "worker", "--store", self.url, "--job", self.version,
             "--poll-seconds", "0.2"], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

    def group(self, slot: int) -> list[int]:
        proc = self.slots[slot]
        return [] if proc is None else [proc.pid, *children(proc.pid)]

    def hurt(self, i: Interruption, now: float) -> None:
        proc = self.slots[i.slot]
        if proc is None or proc.poll() is not None:
            return
        if i.stall:
            if i.slot in self.stalled_until:
                return
            for pid in self.group(i.slot):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            self.stalled_until[i.slot] = now + LEASE_SECONDS + 1.0
            return
        # A death ends a stall too; the replacement starts at once, as on a new machine.
        self.stalled_until.pop(i.slot, None)
        proc.kill()
        proc.wait()
        self.start(i.slot)

    def tend(self, now: float) -> bool:
        """Wakes stalled workers whose stall is over; True while any worker still runs."""
        for slot, until in list(self.stalled_until.items()):
            if now >= until:
                for pid in self.group(slot):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                del self.stalled_until[slot]
        return any(p is not None and p.poll() is None for p in self.slots)

    def stop(self) -> None:
        for slot in range(len(self.slots)):
            for pid in self.group(slot):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            proc = self.slots[slot]
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@dataclass
class RunFigures:
    makespan: float
    splits: int
    take_backs: int
    leases_expired: int
    overhead: float  # mean seconds from a claim to the first result of that lease


def claim_overhead(store: Store, version: str) -> float:
    events = store.events(version, ["claim"])
    results = list(store.iter_results(version))
    gaps = []
    for e in events:
        first = min((r.created_at for r in results if r.shard_no == e.shard_no and r.epoch == e.epoch), default=None)
        if first is not None:
            gaps.append(first - e.ts)
    return statistics.fmean(gaps) if gaps else 0.0


def run(args: argparse.Namespace, tail_split: bool, plan_of: list[Interruption], work: Path) -> RunFigures:
    folder = work / ("split" if tail_split else "whole")
    folder.mkdir()
    url = f"sqlite:///{folder / 'store.db'}"
    store = open_store(url)
    version = plan(load_spec(write_job(folder, args.records, args.seconds_per_record, tail_split)), store).version
    fleet = Fleet(url, version, args.workers, folder)
    started = time.monotonic()
    for slot in range(args.workers):
        fleet.start(slot)
    pending = list(plan_of)
    try:
        while True:
            now = time.monotonic() - started
            while pending and pending[0].at <= now:
                fleet.hurt(pending.pop(0), now)
            info = store.job(version)
            if info is not None and info.state == "sealed":
                break
            if not fleet.tend(now) and not fleet.stalled_until:
                raise RuntimeError(f"every worker exited before the job sealed; see {folder}")
            time.sleep(0.05)
        makespan = time.monotonic() - started
    finally:
        fleet.stop()
    st = store.status(version)
    figures = RunFigures(makespan, st.splits, st.leases_taken_back, st.leases_lost,
                         claim_overhead(store, version))
    store.close()
    return figures


def predicted(args: argparse.Namespace, tail_split: bool, load: float, overhead: float) -> float:
    scenario = sim.Scenario(
        items=args.records, workers=args.workers, records_per_second=1.0 / args.seconds_per_record,
        interruptions_per_hour=args.interruptions_per_hour, stall_share=args.stall_share,
        model_load_seconds=load, lease_seconds=LEASE_SECONDS, stall_extra_seconds=1.0,
        shard_overhead_seconds=overhead, renew_seconds=RENEW_SECONDS, write_batch=BATCH,
        take_back=True, take_back_seconds=0.5, tail_split=tail_split)
    return statistics.fmean(sim.simulate(scenario, sim.Strategy.KEYED_PER_RECORD, SHARD, seed).over_ideal
                            for seed in range(50))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds-per-record", type=float, default=0.02)
    parser.add_argument("--interruptions-per-hour", type=float, default=120.0)
    parser.add_argument("--stall-share", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    ideal_compute = args.records * args.seconds_per_record / args.workers
    plan_of = schedule(args.workers, args.interruptions_per_hour, args.stall_share, 4 * ideal_compute, args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        work = Path(tmp)
        results = {split: run(args, split, plan_of, work) for split in (False, True)}
    # A worker's start-up (interpreter, store, engine child, model load) is the model load here.
    load = LOAD_SECONDS + 1.0
    ideal = ideal_compute + load
    print(f"{args.records:,} records, {args.workers} workers at {1 / args.seconds_per_record:.0f} records/s, "
          f"{len(plan_of)} interruptions scheduled ({sum(i.stall for i in plan_of)} stalls); "
          f"ideal {ideal:.1f} s (the work spread evenly, plus {load:.0f} s start-up)")
    print(f"{'tail split':<11}{'makespan':>10}{'over ideal':>12}{'simulated':>11}{'splits':>8}"
          f"{'taken back':>12}{'expired':>9}{'claim cost':>12}")
    for split, f in results.items():
        print(f"{'on' if split else 'off':<11}{f.makespan:>9.1f}s{f.makespan / ideal:>11.2f}x"
              f"{predicted(args, split, load, f.overhead):>10.2f}x{f.splits:>8}{f.take_backs:>12}"
              f"{f.leases_expired:>9}{f.overhead:>11.2f}s")
    print("simulated: mean over 50 seeds of the same scenario (its own interruptions, not this schedule)")
    print("command: python bench/fleet_makespan.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
