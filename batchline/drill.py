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
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from batchline.errors import BatchlineError
from batchline.spec import JobSpec, stored_spec
from batchline.store import Event, ShardRow, Store, open_store

FAULT_KINDS = ("kill9", "sigstop", "sigterm")
POISON_KINDS = {"crash_on": "crash", "error_on": "engine_error", "hang_on": "hang", "invalid_on": "invalid_output"}
FAULT_WORDS = {"kill9": "kill -9", "sigstop": "SIGSTOP past the lease, then SIGCONT", "sigterm": "SIGTERM"}
FATAL_EXITS = {2, 3, 5}  # the job itself is wrong: restarting would only repeat it

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


# --- results ---------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    passed: bool
    figure: str


@dataclass
class JobFigures:
    version: str
    state: str
    records: int
    results: int
    dead_letters: int
    dead_letters_by_kind: dict[str, int]
    records_lost: int
    duplicate_results: int
    duplicate_in_export: int
    result_and_dead_letter: int
    unexpected: int
    stale_refused: int
    stale_refused_by_op: dict[str, int]
    leases_expired: int
    releases: int
    engine_crashes: int
    engine_hangs: int
    attempts_charged: int
    lost_sample: list[str] = field(default_factory=list)


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the faulted run started
    worker: str
    pid: int
    shard_no: int | None = None  # the shard it held when the fault struck, if any
    epoch: int | None = None
    shifted: float = 0.0  # how far the store's clock was moved to expire its lease
    reclaimed_at: float | None = None  # store time another worker took the shard over (SIGSTOP)
    stalled_for: float = 0.0  # seconds the worker stayed stopped (SIGSTOP)
    note: str = ""
    exit_code: int | None = None


@dataclass
class RunFigures:
    version: str
    makespan: float
    worker_starts: int
    records: int


@dataclass
class DrillResult:
    store_url: str
    seed: int
    workers: int
    work_dir: str
    baseline: RunFigures
    faulted: RunFigures
    faults: list[Fault]
    poison: dict[str, list[str]]
    figures: JobFigures
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def faults_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {k: 0 for k in FAULT_KINDS}
        out.update(Counter(f.kind for f in self.faults))
        for key, ids in self.poison.items():
            out[f"poison_{POISON_KINDS[key]}"] = len(ids)
        return out

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        out["faults_by_kind"] = self.faults_by_kind()
        return out

    def text(self) -> str:
        f = self.figures
        kinds = self.faults_by_kind()
        injected = ", ".join(f"{FAULT_WORDS[k]} {kinds[k]}" for k in FAULT_KINDS)
        poison = ", ".join(f"{POISON_KINDS[k].replace('_', ' ')} {len(v)}" for k, v in self.poison.items())
        slower = (self.faulted.makespan / self.baseline.makespan - 1) if self.baseline.makespan else 0.0
        stale = ", ".join(f"{op} {n}" for op, n in sorted(f.stale_refused_by_op.items())) or "none"
        by_kind = ", ".join(f"{k} {v}" for k, v in sorted(f.dead_letters_by_kind.items())) or "none"
        lines = [
            f"drill of {f.version} on {self.store_url} ({self.workers} workers, seed {self.seed})",
            f"  faults injected     {injected}; poison records: {poison}",
            f"  records             {f.records:,}",
            f"  results             {f.results:,}",
            f"  dead letters        {f.dead_letters:,} ({by_kind})",
            f"  records lost        {f.records_lost:,}",
            f"  duplicate answers   {f.duplicate_results + f.result_and_dead_letter:,} "
            f"({f.duplicate_results} twice in the store, {f.duplicate_in_export} twice in the export, "
            f"{f.result_and_dead_letter} with a result and a dead letter)",
            f"  stale writes refused {f.stale_refused:,} ({stale})",
            f"  leases expired      {f.leases_expired:,}; released {f.releases:,}; engine crashes "
            f"{f.engine_crashes:,}, hangs {f.engine_hangs:,}; attempts charged {f.attempts_charged:,}",
            f"  worker starts       {self.faulted.worker_starts} with faults, {self.baseline.worker_starts} without",
            f"  makespan            {_dur(self.faulted.makespan)} with faults vs {_dur(self.baseline.makespan)} "
            f"without ({slower:+.0%}; lease expiry replaced by clock shifts)",
            "  checks",
        ]
        lines += [f"    {'PASS' if c.passed else 'FAIL'}  {c.name}: {c.figure}" for c in self.checks]
        lines.append(f"  {'PASSED' if self.passed else 'FAILED'}; worker logs in {self.work_dir}/logs")
        return "\n".join(lines)


def _dur(seconds: float) -> str:
    m, s = divmod(seconds, 60)
    return f"{int(m)}m{s:04.1f}s" if m else f"{s:.1f}s"


# --- the checker: from the store alone ---------------------------------------------------------


@dataclass
class _Stored:
    """A version's outcomes as stored, counted per id (a second row for an id is a duplicate)."""

    planned: Counter[str]
    results: Counter[str]
    dead: Counter[str]
    dead_kind: dict[str, str]
    dead_attempts: dict[str, int]
    invalid: list[str]
    last_write: float

    @classmethod
    def read(cls, store: Store, version: str, spec: JobSpec) -> _Stored:
        from batchline.outputs import OutputChecker

        checker = OutputChecker(spec.output_schema)
        t = cls(Counter(store.planned_ids(version)), Counter(), Counter(), {}, {}, [], 0.0)
        for r in store.iter_results(version):
            t.results[r.record_id] += 1
            t.last_write = max(t.last_write, r.created_at)
            if r.origin is None and checker.check(r.output)[1] is not None:
                t.invalid.append(r.record_id)
        for d in store.iter_dead_letters(version):
            t.dead[d.record_id] += 1
            t.dead_kind[d.record_id] = d.kind
            t.dead_attempts[d.record_id] = d.attempts
            t.last_write = max(t.last_write, d.created_at)
        return t


def _exported_ids(store: Store, version: str, work_dir: Path | None) -> Counter[str]:
    """What a reader downstream would get: the export, counted again on its own."""
    from batchline.export import export_jsonl

    counts: Counter[str] = Counter()
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="batchline-drill-check-", dir=work_dir) as scratch:
        export_path = Path(scratch) / f"export-{version.replace('@', '-')}.jsonl"
        export_jsonl(store, version, export_path)
        with export_path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    counts[str(json.loads(line)["id"])] += 1
    return counts


def check_job(store: Store, version: str, *, work_dir: Path | None = None,
              validate_gate: bool = True) -> tuple[JobFigures, list[Check]]:
    """The invariants of a finished drill job, read from the store (and an export)."""
    info = store.job(version)
    if info is None:
        raise BatchlineError(f"no job version {version!r} in {store.url}")
    spec = stored_spec(info)
    stored = _Stored.read(store, version, spec)
    export_counts = _exported_ids(store, version, work_dir)
    planned, results, dead = stored.planned, stored.results, stored.dead
    answered = set(results) | set(dead)
    lost = sorted(set(planned) - answered)
    both = set(results) & set(dead)
    unexpected = answered - set(planned)
    dup_results = sum(n - 1 for n in results.values() if n > 1) + sum(n - 1 for n in dead.values() if n > 1)
    dup_export = sum(n - 1 for n in export_counts.values() if n > 1)

    events = store.events(version)
    kinds = Counter(e.kind for e in events)
    figures = JobFigures(
        version=version, state=info.state, records=sum(planned.values()), results=sum(results.values()),
        dead_letters=sum(dead.values()), dead_letters_by_kind=dict(Counter(stored.dead_kind.values())),
        records_lost=len(lost), duplicate_results=dup_results, duplicate_in_export=dup_export,
        result_and_dead_letter=len(both), unexpected=len(unexpected), stale_refused=kinds["stale_epoch"],
        stale_refused_by_op=dict(Counter(str(e.detail.get("op", "?")) for e in events if e.kind == "stale_epoch")),
        leases_expired=kinds["lease_expired"], releases=kinds["release"], engine_crashes=kinds["engine_crash"],
        engine_hangs=kinds["engine_hang"], attempts_charged=kinds["attempt_failed"], lost_sample=lost[:10],
    )
    cov = store.coverage(version)
    checks = [
        Check("I1 one outcome per record", not (both or dup_results or dup_export or unexpected),
              f"{len(both)} with a result and a dead letter, {dup_results} stored twice, {dup_export} exported "
              f"twice, {len(unexpected)} not in the snapshot" + (f" (e.g. {sorted(both)[:3]})" if both else "")),
        Check("no record lost", not lost,
              f"{len(lost)} of {sum(planned.values()):,} planned ids without an outcome"
              + (f" (e.g. {', '.join(lost[:3])})" if lost else "")),
        Check("the store's own coverage agrees", cov.missing == len(lost) and cov.both == len(both),
              f"coverage(): {cov.missing} missing, {cov.both} both, {cov.unexpected} unexpected"),
        *_poison_checks(spec, stored, events),
    ]
    seal = next((e for e in events if e.kind == "seal"), None)
    sealed_ok = info.state == "sealed" and seal is not None
    after_seal = seal is not None and stored.last_write > seal.ts
    checks.append(Check("I3 sealed, nothing written after", sealed_ok and not after_seal,
                        f"state {info.state}" + (", a write after the seal" if after_seal else "")))
    checks.append(Check("results valid against the schema", not stored.invalid,
                        f"{len(stored.invalid)} invalid of {sum(results.values()):,}"))
    if validate_gate and sealed_ok:
        from batchline.validate import validate

        report = validate(store, version)
        failed = [c.name for c in report.checks if not c.passed]
        checks.append(Check("validation gate", report.passed,
                            "passed" if report.passed else f"failed: {', '.join(failed)}"))
    return figures, checks


def _poison_checks(spec: JobSpec, stored: _Stored, events: list[Event]) -> list[Check]:
    """I4: each poison record is a dead letter of its kind after max_attempts, and nothing else was charged."""
    options = spec.model.options
    max_attempts = spec.shards.max_attempts
    poison = {str(rid): kind for key, kind in POISON_KINDS.items() for rid in options.get(key, ())}
    dead_kind, dead_attempts = stored.dead_kind, stored.dead_attempts
    wrong_kind = sorted(r for r in poison if r in dead_kind and dead_kind[r] != poison[r])
    escaped = sorted(r for r in poison if r not in dead_kind)
    collateral = sorted(r for r in dead_kind if r not in poison and dead_kind[r] != "too_long")
    short = sorted(r for r in poison if r in dead_attempts and dead_attempts[r] != max_attempts)
    charged = {str(e.detail.get("record_id")) for e in events if e.kind == "attempt_failed"}
    healthy_charged = sorted(charged - set(poison))
    return [
        Check("I4 poison costs only itself", not (wrong_kind or escaped or collateral or short),
              f"{len(poison)} poison records: {len(poison) - len(escaped)} dead-lettered, {len(wrong_kind)} with "
              f"the wrong kind, {len(short)} not after {max_attempts} attempts; {len(collateral)} other records "
              f"dead-lettered" + (f" (e.g. {collateral[:3]})" if collateral else "")),
        Check("I4 batch-mates never charged", not healthy_charged,
              f"{len(charged)} records charged an attempt, {len(healthy_charged)} of them not poison"
              + (f" (e.g. {healthy_charged[:3]})" if healthy_charged else "")),
    ]


def fault_checks(store: Store, version: str, faults: list[Fault]) -> list[Check]:
    """That each fault really happened, as the event log tells it, and that no write
    of a stalled worker was accepted after its shard was taken over."""
    events = store.events(version)
    missing: list[str] = []
    for f in faults:
        if f.shard_no is None:
            continue  # it held no lease when it was hurt: nothing for the log to show
        mine = [e for e in events if e.worker == f.worker and e.shard_no == f.shard_no and e.epoch == f.epoch]
        if f.kind == "kill9":
            # Another worker proves it dead and takes its lease back, or the lease runs out.
            ok = any(e.kind in ("lease_expired", "take_back") for e in mine)
        elif f.kind == "sigstop":
            ok = any(e.kind == "lease_expired" for e in mine) and (
                f.note == "killed" or any(e.kind == "stale_epoch" for e in events if e.worker == f.worker))
        else:
            ok = any((e.kind == "release" and e.detail.get("reason") == "stop") or e.kind == "complete"
                     for e in mine)
        if not ok:
            missing.append(f"{f.kind} of {f.worker} on shard {f.shard_no}")
    checks = [Check("every fault is in the event log", not missing,
                    f"{len(faults)} faults, {len(missing)} without their evidence"
                    + (f" ({'; '.join(missing[:3])})" if missing else ""))]
    late: list[str] = []
    stalls = [f for f in faults if f.kind == "sigstop" and f.shard_no is not None and f.reclaimed_at is not None]
    if stalls:
        taken_over: dict[tuple[str | None, int | None, int | None], float] = {
            (f.worker, f.shard_no, f.epoch): f.reclaimed_at for f in stalls if f.reclaimed_at is not None}
        for r in store.iter_results(version):
            at = taken_over.get((r.worker, r.shard_no, r.epoch))
            if at is not None and r.created_at > at:
                late.append(r.record_id)
        # A dead letter does not carry its epoch, and a stalled worker that wakes up may
        # later claim the same shard again under a new one: its epoch at the time of a
        # write is that of its latest claim of the shard before the write.
        claims: dict[tuple[str | None, int | None], list[tuple[float, int | None]]] = {}
        for e in events:
            if e.kind == "claim":
                claims.setdefault((e.worker, e.shard_no), []).append((e.ts, e.epoch))
        for d in store.iter_dead_letters(version):
            held = [epoch for ts, epoch in claims.get((d.worker, d.shard_no), []) if ts <= d.created_at]
            at = taken_over.get((d.worker, d.shard_no, held[-1] if held else None))
            if at is not None and d.created_at > at:
                late.append(d.record_id)
    checks.append(Check("stalled workers fenced off", not late,
                        f"{len(stalls)} stalls; {len(late)} writes accepted after the shard was taken over"))
    codes = [f for f in faults if f.kind == "sigterm" and f.exit_code not in (None, 0, 75)]
    checks.append(Check("SIGTERM exits 75", not codes,
                        f"{sum(1 for f in faults if f.kind == 'sigterm')} SIGTERMs, "
                        f"{len(codes)} with another exit status"
                        + (f" ({[f.exit_code for f in codes]})" if codes else "")))
    return checks


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
    options: dict[str, Any] = {"seconds_per_record": SECONDS_PER_RECORD, "batch_size": BATCH_SIZE,
                               **(poison or {})}
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
        from batchline.planner import plan as plan_job
        from batchline.spec import load_spec

        self.say(f"drill on {self.store_url}: {plan.records:,} records in shards of {plan.shard_size}, "
                 f"{self.workers} workers, seed {self.seed}, work dir {self.work}")
        base_spec = load_spec(_write_job(self.work, plan, self.run_id, None))
        base_version = plan_job(base_spec, self.store).version
        budget = self.minutes * 60.0
        self.say(f"without faults: {base_version}")
        base_makespan, base_fleet = self._run(base_version, plan.records, None, self.work / "logs" / "baseline",
                                              timeout=max(120.0, 3 * budget))
        self.say(f"without faults: sealed in {_dur(base_makespan)}")

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
        self.say(f"with faults: sealed in {_dur(makespan)}; checking")
        figures, checks = check_job(self.store, version, work_dir=self.work)
        checks += fault_checks(self.store, version, faults)
        return DrillResult(
            store_url=self.store_url, seed=self.seed, workers=self.workers, work_dir=str(self.work),
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
