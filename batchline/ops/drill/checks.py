"""The drill's invariant checker: what a version's store says about I1-I5, from the store alone."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchline.spec import JobSpec, stored_spec
from batchline.store import Event, Store, require_job

FAULT_KINDS = ("kill9", "sigstop", "sigterm")
POISON_KINDS = {"crash_on": "crash", "error_on": "engine_error", "hang_on": "hang", "invalid_on": "invalid_output"}
FAULT_WORDS = {"kill9": "kill -9", "sigstop": "SIGSTOP past the lease, then SIGCONT", "sigterm": "SIGTERM"}
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
    store: str  # as messages name it: without a password
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
        del out["store_url"]  # it may hold a password: "store" names it as messages do
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
            f"drill of {f.version} on {self.store} ({self.workers} workers, seed {self.seed})",
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
            f"  makespan            {duration(self.faulted.makespan)} with faults vs {duration(self.baseline.makespan)} "
            f"without ({slower:+.0%}; lease expiry replaced by clock shifts)",
            "  checks",
        ]
        lines += [f"    {'PASS' if c.passed else 'FAIL'}  {c.name}: {c.figure}" for c in self.checks]
        lines.append(f"  {'PASSED' if self.passed else 'FAILED'}; worker logs in {self.work_dir}/logs")
        return "\n".join(lines)


def duration(seconds: float) -> str:
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
        from batchline.check.outputs import OutputChecker

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
    from batchline.targets.files import export_jsonl

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
    info = require_job(store, version)
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
        from batchline.check.validate import validate

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


