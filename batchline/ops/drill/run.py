"""`batchline drill`: hurt a deployment's workers on purpose, then prove nothing broke.

An operator runs it against a new store before trusting it with a backfill.
It plans a synthetic job (the `synthetic` engine, with poison records that
crash the engine, raise an engine error, hang, or return invalid output), runs
it once with real `batchline worker` processes and no faults to measure the
makespan, then runs the same job again (a new version: the poison is part of
the engine options) while hurting its own workers at random: `kill -9`,
`SIGSTOP` past the lease then `SIGCONT`, and SIGTERM. Leases are pushed past
their expiry with the store's clock hook instead of waiting them out, and each
shift is logged as a `clock_shift` event so reports can take it back out.

Then it checks the invariants from the store alone (`check_job`, which also
re-checks any stored version: `batchline drill --check VERSION`):

- I1: one outcome per record: no record with two results (in the store and
  in an export), none with both a result and a dead letter, none lost (a
  planned id without any outcome), none unexpected;
- I4: poison costs only itself: exactly the poison records are dead letters,
  with the kind of their poison, after `max_attempts` charges, and no other
  record was ever charged an attempt;
- I3: the version is sealed and nothing was written after the seal;
- every stored result is valid against the schema, and the validation gate
  passes;

and, for the run it made, that each fault really happened (the event log
shows the killed worker's lease taken back or expired, the stalled worker's
refused stale write, the release on SIGTERM) and
that no write of a stalled worker was accepted once its lease was taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from batchline.errors import BatchlineError
from batchline.launch import FATAL_EXITS
from batchline.ops.drill.checks import (
    FAULT_KINDS,
    FAULT_WORDS,
    DrillResult,
    Fault,
    RunFigures,
    check_job,
    duration,
    fault_checks,
)
from batchline.store import ShardRow, Store, open_store

# The synthetic job. Records are cheap (seconds_per_record) so a drill of a few
# minutes runs thousands of them; batch deadlines leave a wide margin over a
# record's cost, so only a real hang (not a loaded CI machine) misses one.
SECONDS_PER_RECORD = 0.05
PER_WORKER_EFFICIENCY = 0.7  # of 1/seconds_per_record, with writes, restarts and a shared CPU
SHARDS_PER_WORKER = 10
LEASE_SECONDS = 30.0
RENEW_SECONDS = 1.0
BATCH_SIZE = 4
RECORD_TIMEOUT = 0.75
BATCH_TIMEOUT = 1.5
GRACE_SECONDS = 5.0
POLL_SECONDS = 0.2
# A drill's share of its minutes: the run without faults, then the one with them.
BASELINE_SHARE = 0.3

SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "outage", "access", "hardware", "other"]},
        "summary": {"type": "string", "maxLength": 60},
    },
    "required": ["category", "summary"],
    "additionalProperties": False,
}
TOPICS = ("invoice was charged twice", "VPN drops every hour", "cannot log in after reset",
          "laptop fan is loud", "printer offline on floor 3", "refund not received",
          "disk quota exceeded", "badge does not open door")


# --- worker processes ----------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """A process's children (a worker's engine child), from /proc."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def gone(pid: int) -> bool:
    """True once a process has exited (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def owner_pid(owner: str) -> int | None:
    # Worker ids are host:pid:suffix (batchline.worker.supervisor.new_worker_id).
    parts = owner.rsplit(":", 2)
    try:
        return int(parts[1]) if len(parts) == 3 else None
    except ValueError:
        return None


class _Fleet:
    """N `batchline worker` processes on one version, replaced when they die, as
    `batchline run` or an orchestrator would."""

    def __init__(self, store_url: str, version: str, n: int, log_dir: Path) -> None:
        self.store_url = store_url
        self.version = version
        self.n = n
        self.log_dir = log_dir
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopped: set[int] = set()
        self.hurt: set[int] = set()  # hurt once already: a second fault would muddle the first's evidence
        self.exits: dict[int, int] = {}
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = (self.log_dir / f"worker-{self.starts:03d}.log").open("ab")
        cmd = [sys.executable, "-m", "batchline", "worker", "--store", self.store_url, "--job", self.version,
               "--poll-seconds", str(POLL_SECONDS)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
        log.close()
        self.procs[proc.pid] = proc

    def maintain(self, open_work: bool) -> None:
        for pid, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.procs[pid]
            self.exits[pid] = code
            if code in FATAL_EXITS:
                raise BatchlineError(f"a drill worker failed with exit status {code}; see {self.log_dir}")
        while open_work and len(self.procs) < self.n:
            self.start()

    def alive(self) -> list[int]:
        return [pid for pid in self.procs if pid not in self.stopped and pid not in self.hurt]

    def stop_all(self) -> None:
        for pid, proc in self.procs.items():
            if proc.poll() is None:
                for p in [pid, *children(pid)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGCONT)
                proc.kill()
        for pid, proc in self.procs.items():
            self.exits[pid] = proc.wait()
        self.procs.clear()


# --- the drill ------------------------------------------------------------------------------


@dataclass
class DrillPlan:
    records: int
    shard_size: int
    poison: dict[str, list[str]]
    faults: int


def plan_drill(workers: int, minutes: float, rng: random.Random) -> DrillPlan:
    baseline_seconds = max(5.0, BASELINE_SHARE * minutes * 60.0 - 2.0)
    rate = workers * PER_WORKER_EFFICIENCY / SECONDS_PER_RECORD
    records = max(200, int(baseline_seconds * rate))
    shard_size = max(20, records // (workers * SHARDS_PER_WORKER))
    ids = [f"d{i:06d}" for i in range(records)]
    # A poison record costs seconds of bisecting (a hang: its batch deadlines), so
    # there are a few of each, more in a longer drill.
    counts = {"crash_on": max(1, round(minutes)), "error_on": max(1, round(minutes)),
              "hang_on": max(1, round(minutes / 1.5)), "invalid_on": max(1, round(minutes))}
    chosen = rng.sample(ids, sum(counts.values()))
    poison: dict[str, list[str]] = {}
    for key, n in counts.items():
        poison[key], chosen = sorted(chosen[:n]), chosen[n:]
    return DrillPlan(records, shard_size, poison, max(3, round(minutes * 3)))


def _write_job(work: Path, plan: DrillPlan, run_id: str, poison: dict[str, list[str]] | None) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    data = work / "input.jsonl"
    if not data.exists():
        with data.open("w", encoding="utf-8") as f:
            for i in range(plan.records):
                f.write(json.dumps({"id": f"d{i:06d}", "text": f"ticket {i}: {TOPICS[i % len(TOPICS)]}",
                                    "acl": [f"team-{i % 4}"]}) + "\n")
    (work / "schema.json").write_text(json.dumps(SCHEMA))
    options: dict[str, Any] = {"seconds_per_record": SECONDS_PER_RECORD, **(poison or {})}
    spec = {
        "name": "batchline-drill",
        "input": {"path": str(data), "id_field": "id", "text_field": "text", "acl_field": "acl"},
        "model": {"engine": "synthetic", "options": options},
        # The run id keeps every drill a new version: a drill never finds its job already done.
        "prompt": {"text": "Triage this ticket.\n", "version": f"drill-{run_id}"},
        "output": {"schema": "schema.json", "label_field": "category"},
        "shards": {"size": plan.shard_size, "max_attempts": 3, "lease_seconds": LEASE_SECONDS,
                   "renew_seconds": RENEW_SECONDS, "batch_size": BATCH_SIZE,
                   "record_timeout_seconds": RECORD_TIMEOUT, "batch_timeout_seconds": BATCH_TIMEOUT,
                   "grace_seconds": GRACE_SECONDS},
        "validate": {"max_dead_letter_rate": 0.05},
    }
    path = work / ("faulted.yaml" if poison else "baseline.yaml")
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class Drill:
    def __init__(self, store_url: str | None = None, *, workers: int = 4, minutes: float = 3.0,
                 seed: int | None = None, work_dir: Path | None = None,
                 out: IO[str] | None = None) -> None:
        if workers < 2:
            raise BatchlineError("--workers must be at least 2: a fault needs a worker left to take over")
        if minutes <= 0:
            raise BatchlineError("--minutes must be positive")
        # Absolute: the job spec names its input by this path, and workers resolve it from elsewhere.
        self.work = (Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="batchline-drill-"))).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.store_url = store_url or f"sqlite:///{self.work / 'drill.db'}"
        self.workers = workers
        self.minutes = minutes
        self.seed = seed if seed is not None else random.SystemRandom().randrange(1, 2**31)
        self.rng = random.Random(self.seed)
        self.out = out or sys.stderr
        self.run_id = uuid.uuid4().hex[:12]
        self.store: Store = open_store(self.store_url)
        self._t0 = time.monotonic()

    def say(self, text: str) -> None:
        self.out.write(f"[{time.monotonic() - self._t0:6.1f}s] {text}\n")
        self.out.flush()

    # -- running a version to its seal --

    def _run(self, version: str, records: int, inject: Callable[[_Fleet, float], None] | None,
             logs: Path, timeout: float) -> tuple[float, _Fleet]:
        logs.mkdir(parents=True, exist_ok=True)
        fleet = _Fleet(self.store_url, version, self.workers, logs)
        started = time.monotonic()
        last_say = 0.0
        try:
            fleet.maintain(open_work=True)
            makespan: float | None = None
            while True:
                now = time.monotonic()
                info = self.store.job(version)
                sealed = info is not None and info.state == "sealed"
                if sealed and makespan is None:
                    makespan = now - started
                fleet.maintain(open_work=not sealed)
                if sealed and not fleet.procs:
                    break
                if now - started > timeout:
                    raise BatchlineError(f"{version} did not finish within {timeout:.0f}s; "
                                         f"worker logs in {logs}")
                if not sealed and inject is not None:
                    inject(fleet, now - started)
                if now - last_say >= 5.0:
                    st = self.store.status(version)
                    self.say(f"{st.results + st.dead_letters:,}/{records:,} records, {len(fleet.procs)} workers, "
                             f"{st.leases_lost} leases lost")
                    last_say = now
                if sealed and now - started - (makespan or 0.0) > 60:
                    raise BatchlineError(f"workers did not exit within 60s of the seal; logs in {logs}")
                time.sleep(0.1)
        finally:
            fleet.stop_all()
        assert makespan is not None
        return makespan, fleet

    # -- faults --

    def _held(self, version: str, worker: str) -> ShardRow | None:
        return next((r for r in self.store.shard_rows(version) if r.state == "leased" and r.owner == worker), None)

    def _expire(self, version: str, row: ShardRow | None) -> float:
        """Moves the store's clock just past this lease's expiry, instead of waiting.
        Just past it, not a whole lease: the other workers renewed after the victim
        last did, so their leases still hold and no healthy shard is taken."""
        if row is None or row.lease_expires is None:
            return 0.0
        seconds = row.lease_expires - self.store.now() + 0.05
        if seconds <= 0:
            return 0.0
        # Logged before the shift so a report can tell the shifted times apart.
        self.store.log_event("clock_shift", version=version, detail={"seconds": seconds})
        self.store.shift_clock(seconds)
        return seconds

    def _victim(self, fleet: _Fleet, version: str) -> tuple[str, int] | None:
        mine = set(fleet.alive())
        rows = [r for r in self.store.shard_rows(version)
                if r.state == "leased" and r.owner and owner_pid(r.owner) in mine]
        # A shard partly done is the interesting case: some records stored, some in flight.
        partly = [r for r in rows if 0 < r.results + r.dead_letters < r.record_count]
        pick = partly or rows
        if not pick:
            return None
        row = self.rng.choice(pick)
        assert row.owner is not None
        pid = owner_pid(row.owner)
        assert pid is not None
        return row.owner, pid

    def _wait(self, fleet: _Fleet, condition: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            fleet.maintain(open_work=True)
            time.sleep(0.05)
        return condition()

    def _inject(self, kind: str, fleet: _Fleet, version: str, at: float) -> Fault | None:
        victim = self._victim(fleet, version)
        if victim is None:
            return None
        worker, pid = victim
        fleet.hurt.add(pid)
        group = [pid, *children(pid)]
        fault = Fault(kind, round(at, 2), worker, pid)
        if kind == "kill9":
            os.kill(pid, signal.SIGKILL)
            self._wait(fleet, lambda: all(gone(p) for p in group), 10.0)
            row = self._held(version, worker)  # what it held when it died, not a moment before
            fault.shard_no, fault.epoch = (row.shard_no, row.epoch) if row else (None, None)
            if row is not None:
                # Let the others renew once more, so their leases outlast the victim's.
                self._wait(fleet, lambda: False, RENEW_SECONDS + 0.3)
            fault.shifted = self._expire(version, row)
            fault.exit_code = -9
        elif kind == "sigterm":
            row = self._held(version, worker)
            fault.shard_no, fault.epoch = (row.shard_no, row.epoch) if row else (None, None)
            os.kill(pid, signal.SIGTERM)
        else:
            for p in group:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGSTOP)
            fleet.stopped.add(pid)
            row = self._held(version, worker)
            fault.shard_no, fault.epoch = (row.shard_no, row.epoch) if row else (None, None)
            if row is not None:
                self._wait(fleet, lambda: False, RENEW_SECONDS + 0.3)
                fault.shifted = self._expire(version, row)
                shard, epoch = row.shard_no, row.epoch

                def taken() -> bool:
                    now = self.store.shard_rows(version)[shard]
                    return now.epoch > epoch or now.state == "done"

                # Until another worker takes it over; one finishes a shard in about this long.
                reclaim_timeout = 3.0 * row.record_count * SECONDS_PER_RECORD + 20.0
                stopped_at = time.monotonic()
                taken_over = self._wait(fleet, taken, reclaim_timeout)
                fault.stalled_for = round(time.monotonic() - stopped_at, 2)
                if taken_over:
                    claim = [e for e in self.store.events(version, ["lease_expired"])
                             if e.shard_no == shard and e.epoch == epoch]
                    fault.reclaimed_at = claim[0].ts if claim else None
                else:
                    # Waking it with its lease still current would be no test of fencing.
                    fault.note = "killed"
                    os.kill(pid, signal.SIGKILL)
            for p in group:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGCONT)
            fleet.stopped.discard(pid)
        return fault

    # -- the whole drill --

    def run(self) -> DrillResult:
        plan = plan_drill(self.workers, self.minutes, self.rng)
        from batchline.plan.planner import plan as plan_job
        from batchline.spec import load_spec

        self.say(f"drill on {self.store.where()}: {plan.records:,} records in shards of {plan.shard_size}, "
                 f"{self.workers} workers, seed {self.seed}, work dir {self.work}")
        base_spec = load_spec(_write_job(self.work, plan, self.run_id, None))
        base_version = plan_job(base_spec, self.store).version
        budget = self.minutes * 60.0
        self.say(f"without faults: {base_version}")
        base_makespan, base_fleet = self._run(base_version, plan.records, None, self.work / "logs" / "baseline",
                                              timeout=max(120.0, 3 * budget))
        self.say(f"without faults: sealed in {duration(base_makespan)}")

        spec = load_spec(_write_job(self.work, plan, self.run_id, plan.poison))
        version = plan_job(spec, self.store).version
        faults: list[Fault] = []
        # Faults come at random moments over most of the expected run, in rounds that
        # each hold every kind once, so even a short drill sees each kind.
        window = 0.8 * base_makespan
        kinds: list[str] = []
        next_at = [self.rng.uniform(0.1, 0.25) * window]

        def inject(fleet: _Fleet, at: float) -> None:
            # Not in the tail: once the last shards are in hand there is nobody left to hurt
            # usefully, and a stall there would only wait for a taker that never comes.
            if at < next_at[0] or len(faults) >= plan.faults or at > max(1.5 * base_makespan, base_makespan + 20):
                return
            if not kinds:
                kinds.extend(self.rng.sample(FAULT_KINDS, len(FAULT_KINDS)))
            fault = self._inject(kinds[0], fleet, version, at)
            if fault is None:
                next_at[0] = at + 0.5  # nobody holds a lease right now; try again shortly
                return
            kinds.pop(0)
            faults.append(fault)
            self.say(f"{FAULT_WORDS[fault.kind]} worker {fault.worker}"
                     + (f" holding shard {fault.shard_no} (epoch {fault.epoch})" if fault.shard_no is not None
                        else " between shards")
                     + (f"; clock moved {fault.shifted:.1f}s" if fault.shifted else "")
                     + (f"; stopped {fault.stalled_for:.1f}s until another worker took its shard"
                        if fault.stalled_for and not fault.note else "")
                     + (f"; {fault.note}" if fault.note else ""))
            next_at[0] = at + self.rng.uniform(0.5, 1.5) * window / plan.faults

        self.say(f"with faults: {version}")
        makespan, fleet = self._run(version, plan.records, inject, self.work / "logs" / "faulted",
                                    timeout=max(180.0, 4 * budget))
        for f in faults:
            if f.kind == "sigterm":
                f.exit_code = fleet.exits.get(f.pid)
        self.say(f"with faults: sealed in {duration(makespan)}; checking")
        figures, checks = check_job(self.store, version, work_dir=self.work)
        checks += fault_checks(self.store, version, faults)
        return DrillResult(
            store_url=self.store_url, store=self.store.where(), seed=self.seed, workers=self.workers, work_dir=str(self.work),
            baseline=RunFigures(base_version, base_makespan, base_fleet.starts, plan.records),
            faulted=RunFigures(version, makespan, fleet.starts, plan.records),
            faults=faults, poison=plan.poison, figures=figures, checks=checks)

    def close(self) -> None:
        self.store.close()


def run_drill(store_url: str | None = None, *, workers: int = 4, minutes: float = 3.0, seed: int | None = None,
              work_dir: Path | None = None, out: IO[str] | None = None) -> DrillResult:
    drill = Drill(store_url, workers=workers, minutes=minutes, seed=seed, work_dir=work_dir, out=out)
    try:
        return drill.run()
    finally:
        drill.close()
