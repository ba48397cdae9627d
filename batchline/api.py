"""batchline from Python: what the command line does, for notebooks and orchestrators.

`Jobs` is a handle on one store, through which jobs are planned, run, checked,
published and exported:

    import batchline

    jobs = batchline.Jobs("sqlite:///jobs.db")
    run = jobs.run("job.yaml", workers=2)
    if jobs.validate(run.version).passed:
        jobs.publish(run.version)

The store is a URL (`sqlite:///path.db`, `postgresql://...`; by default
`$BATCHLINE_STORE` or `sqlite:///batchline.db`), opened for each call and
closed after it, or a store already opened with `batchline.store.open_store`,
which is used and left open. Failures raise the command line's errors:
`BatchlineError` and its subclasses, whose `exit_code` is the status the
command would exit with (`SpecError` 2, `InputError` 3, `StoreError` 4,
`EngineFatal` 5, `VersionHalted` 7). Only `plan` and `run` make a store that does not exist yet;
every other call refuses it by its path.

Heavy modules (the readers, pyarrow, a PostgreSQL driver) are imported by the
calls that need them, so importing batchline costs nothing. (The methods are
not module-level functions: `batchline.check`, `batchline.publish` and
`batchline.ops.report` are packages.)
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

from batchline.errors import BatchlineError, SpecError, VersionEnded, VersionHalted

if TYPE_CHECKING:
    from batchline.acl import Groups
    from batchline.check.report import ValidationReport
    from batchline.launch.pacer import PaceReport
    from batchline.ops.report.data import ReportData
    from batchline.plan.planner import PlanPreview, PlanResult
    from batchline.publish.pointer import PublishResult
    from batchline.publish.search import SearchResult
    from batchline.spec import JobSpec
    from batchline.store import DeadLetterBound, JobStatus, Store, StoredDeadLetter
    from batchline.store.lineage import OutboxRow
    from batchline.store.model import Publication
    from batchline.targets.base import ExportResult

__all__ = ["ExportFormat", "ExportResult", "JobListing", "Jobs", "LineageOutbox", "RunResult", "SearchResult"]

# An export format: a name of the EXPORTS table (batchline.registry), such as jsonl.
ExportFormat = str
# How long a command that changed a version's state waits, at most, for its lineage events to go
# out before it returns (what is not sent by then stays in the store for the next process).
LINEAGE_DRAIN_SECONDS = 5.0


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


@dataclass(frozen=True)
class RunResult:
    version: str
    planned: bool  # planned by this run (False: it found the version planned already)
    status: JobStatus  # as the run ended
    seconds: float
    workers: int
    worker_starts: int
    restarts: int
    log_dir: Path  # the workers' logs
    exit_code: int  # 0: sealed; 75: stopped early with work left (run again to go on)
    answered: int = 0  # records this run gave an outcome (not those carried or answered before it)
    pace: PaceReport | None = None  # what the run's pacer saw last (with a fallback section)
    reclaims: int = 0  # spot workers a --spot-trace drill killed
    validation: ValidationReport | None = None  # with publish=True
    publication: PublishResult | None = None

    @property
    def sealed(self) -> bool:
        return self.status.state == "sealed"


@dataclass(frozen=True)
class JobListing:
    version: str
    name: str
    state: str  # ready | halted | sealed | cancelled
    records: int
    shards: int
    created_at: float
    published: bool  # the version readers of `name` see now


@dataclass(frozen=True)
class LineageOutbox:
    rows: list[OutboxRow]  # oldest first
    sent: int = 0  # sent now (`send`)
    failed: int = 0  # sends that failed now: the receiver is down, the rows wait for their next try
    retried: int = 0  # rows given up on, due again (`retry`)


class Jobs:
    """The jobs of one store."""

    def __init__(self, store: str | Store | None = None) -> None:
        self.store = store

    @contextlib.contextmanager
    def _opened(self, *, create: bool = False, lineage: bool = False) -> Iterator[Store]:
        """The store; `lineage`: an operation that may change a version's state, after which
        the lineage outbox is drained (for a bounded time) where lineage is on, and whose
        lineage configuration, if malformed, is refused before it does anything."""
        with self._lineage(lineage) as drain:
            if self.store is not None and not isinstance(self.store, str):
                try:
                    yield self.store  # the caller's: it stays open
                finally:
                    drain(self.store.url)
                return
            from batchline.store import open_store

            opened = open_store(self.store, create=create)
            try:
                yield opened
            except BaseException:
                drain(opened.url)
                opened.close_discarding()  # a failed first plan leaves no empty store behind
                raise
            drain(opened.url)
            opened.close()

    @staticmethod
    @contextlib.contextmanager
    def _lineage(wanted: bool) -> Iterator[Callable[[str], None]]:
        from batchline.lineage import lineage_config

        config = lineage_config() if wanted else None

        def drain(url: str) -> None:
            if config is None:
                return
            from batchline.lineage.drain import drain_beside
            from batchline.store import open_store

            drainer = drain_beside(lambda: open_store(url, create=False), config)
            if drainer is not None:
                drainer.close(LINEAGE_DRAIN_SECONDS)

        yield drain

    @staticmethod
    def _resolve(s: Store, target: str) -> str:
        from batchline.store import job_or_published

        return job_or_published(s, target).version

    def resolve(self, target: str) -> str:
        """The job version `target` names: itself, or the version published under that name."""
        with self._opened() as s:
            return self._resolve(s, target)

    # --- planning and running ---------------------------------------------------------------

    def plan(self, spec: str | Path, *, plan_key: str | None = None, create_store: bool = True,
             log: Callable[[str], None] = _stderr) -> PlanResult:
        """Plans the job if its version is new (`created`). `log` gets what planning says,
        among it where records go and what each hosted provider keeps: said before anything
        is sent, so it goes to stderr unless told otherwise. `plan_key` (a scheduled run's
        key, as `run` takes it): the first plan with it keys the version planned, and every
        later one with it returns that version, whatever the input has become (a retried
        task after a glob or a table's snapshot moved). `create_store`: False for a caller that
        must never make a store (a scheduled task: a mistyped path is refused with
        `StoreMissing`, not a new, empty store that computes everything again)."""
        from batchline.spec import load_spec

        job = load_spec(spec)
        with self._opened(create=create_store) as s:
            _say_created(s, log)
            return _plan_once(s, job, plan_key, log)

    def preview(self, spec: str | Path, *, log: Callable[[str], None] = _stderr) -> PlanPreview:
        """What `plan` would do now, writing nothing (a store that does not exist is not made):
        the version, the records it would carry from its base (those under a changed ACL
        among them), infer (new, changed text, base dead letters retried), drop (removed from
        the input) and dead-letter at planning."""
        from batchline.errors import StoreError
        from batchline.plan.planner import preview
        from batchline.spec import load_spec
        from batchline.store import open_store

        job = load_spec(spec)
        if self.store is not None and not isinstance(self.store, str):
            return preview(job, self.store, log=log)
        try:
            opened = open_store(self.store, create=False)
        except StoreError:
            if not (self.store or "sqlite:").startswith("sqlite:"):
                raise
            return preview(job, None, log=log)  # no store yet: nothing to carry from
        try:
            return preview(job, opened, log=log)
        finally:
            opened.close()

    def changes(self, version: str) -> Iterator[tuple[str, str]]:
        """Each record of `version` by kind against the base it was planned on (new, text, acl,
        unchanged), then each record of the base it dropped (removed), in id order; refused
        for a version planned without a base."""
        from batchline.store import require_job

        with self._opened() as s:
            base = require_job(s, version).spec.get("base_version")
            if not base:
                raise BatchlineError(f"{version} was planned without a base version: every record was inferred")
            if s.job(base) is None:
                raise BatchlineError(f"{version}'s base {base} is no longer in {s.where()} (removed by retention)")
            for record_id, kind in s.record_changes(version, base):
                yield kind, record_id
            for record_id in s.removed_records(version, base):
                yield "removed", record_id

    def run(self, spec: str | Path, *, workers: int = 1, log_dir: str | Path | None = None, publish: bool = False,
            plan_key: str | None = None, progress: IO[str] | None = sys.stderr,
            log: Callable[[str], None] = _stderr, deadline: str | None = None,
            spot_trace: str | Path | None = None, spot_trace_start: float = 0.0,
            region: str | None = None) -> RunResult:
        """Plans the job if it is new and keeps `workers` local worker processes running until
        every shard is done; `publish`: then validates the version and publishes it if it
        passes (`BatchlineError` if it does not), unless its name shows it already.
        `plan_key` (a scheduled run's key, such as its scheduled minute): the first run with
        this key plans and keys the version; every later run with it (a restarted worker
        slot, another slot) runs that version, whatever the input looks like by then.
        `progress` gets the live progress line (None: nowhere); `log_dir`: the workers' logs
        (default: a folder of this run's own). Stopped early (SIGINT or SIGTERM, when run
        from the main thread), it returns with `exit_code` 75 and the work left in the
        store for the next run. `region`: where the local workers run (they read its replica of
        the input and claim its shards first); one the input does not know is refused."""
        from batchline.ops.runner import LocalRunner, default_log_dir
        from batchline.sizing.paced import Trace
        from batchline.spec import load_spec
        from batchline.spec.deadline import parse_deadline

        if workers < 0 or (workers == 0 and spot_trace is not None):
            raise BatchlineError(f"workers must be at least {1 if spot_trace is not None else 0}, not {workers}")
        job = load_spec(spec)

        def refuse(where: str, why: str) -> NoReturn:
            raise SpecError(f"{where}: {why}")

        held = parse_deadline(deadline, "--deadline", refuse) if deadline is not None else job.deadline
        trace = Trace.load(spot_trace, workers=workers, start_seconds=spot_trace_start) \
            if spot_trace is not None else None
        with self._opened(create=True, lineage=True) as s, contextlib.ExitStack() as closing:
            refusal = held.refusal(s.now()) if held is not None else None
            if refusal is not None:
                raise SpecError(refusal)  # before anything is planned or started
            _say_created(s, log)
            planned = _plan_once(s, job, plan_key, log)
            version, created = planned.version, planned.created
            log(f"version {version}")
            _refuse_cancelled(s, version)
            halt = s.halt_of(version)
            if halt is not None:
                # Its bound is the store's: resuming it is a decision, not a side effect of a rerun.
                raise VersionHalted(halt.message(version))
            out = progress if progress is not None else closing.enter_context(open(os.devnull, "w"))
            if region is not None:
                from batchline.spec import stored_spec
                from batchline.store import require_job

                stored_spec(require_job(s, version)).input.regions.check_worker(region, tuple(s.replicas(version)))
            runner = LocalRunner(s, version, workers, out=out,
                                 log_dir=Path(log_dir) if log_dir is not None else default_log_dir(s.url, version),
                                 deadline=held, spot_trace=trace, region=region)
            summary = runner.run()
            _refuse_cancelled(s, version)
            result = RunResult(version, created, summary.status, summary.seconds, workers,
                               summary.worker_starts, summary.restarts, summary.log_dir, summary.exit_code,
                               summary.answered, pace=summary.pace, reclaims=summary.reclaims)
            if publish and summary.exit_code == 0:
                validation, publication = self.validate_and_publish(version, log=log)
                result = replace(result, validation=validation, publication=publication)
            return result

    # --- reading -------------------------------------------------------------------------------

    def status(self, target: str) -> JobStatus:
        """Progress of a version (or of the version published under a name): shards by
        state, results, dead letters, leases lost."""
        with self._opened() as s:
            return s.status(self._resolve(s, target))

    def versions(self) -> list[JobListing]:
        """Every job version in the store, oldest first, marking the published one of each name."""
        with self._opened() as s:
            pointers = s.published()
            return [JobListing(j.version, j.name, j.state, j.record_count, j.shard_count, j.created_at,
                               pointers.get(j.name) == j.version) for j in s.jobs()]

    def dead_letters(self, target: str) -> list[StoredDeadLetter]:
        """The records of a version that ended as dead letters, with their errors."""
        with self._opened() as s:
            return list(s.iter_dead_letters(self._resolve(s, target)))

    def history(self, name: str) -> list[Publication]:
        """Every publish and rollback of `name`, oldest first: when, who, which version (and
        the one before), the reason given, the validation figures it was published on."""
        with self._opened() as s:
            found = s.publications(name)
            if not found and not any(j.name == name for j in s.jobs()):
                raise BatchlineError(f"no job named {name!r} in {s.where()}")
            return found

    # --- validation and publication -----------------------------------------------------------

    def validate(self, target: str, *, log: Callable[[str], None] = _stderr) -> ValidationReport:
        """Runs the gate on a sealed version and records its report; `passed` says whether
        it may be published. A judge (`validate.judge`) is a job of its own, run here with
        local workers to its seal (continued, never recomputed, by a later validate); `log`
        gets its planning lines."""
        from batchline.check.validate import validate
        from batchline.worker.recompute import recompute

        with self._opened(lineage=True) as s:
            return validate(s, self._resolve(s, target), recompute=recompute,
                            run_job=functools.partial(_run_to_seal, s, log))

    def publish(self, version: str, *, force: bool = False, reason: str | None = None,
                plan_key: str | None = None, over_newer: str | None = None,
                log: Callable[[str], None] = _stderr) -> PublishResult:
        """Points the job's name (and its view) at a sealed version whose latest validation
        passed; `force` with a `reason` publishes without one. The version published
        already is left as it is and history records nothing (`changed` is False).
        `plan_key` (a scheduled run's, as `plan` took it): published only if the name's
        pointer is where it was when that run first planned (`PointerMovedOn` otherwise: a
        cleared old run never moves it past a newer one's), unless `over_newer` says why."""
        from batchline.publish.pointer import publish

        with self._opened(lineage=True) as s:
            since = None
            if plan_key is not None:
                info = s.job(version)
                since = s.keyed_pointer(info.name, plan_key) if info is not None else None
            return publish(s, version, force=force, reason=reason, log=log, since=since, over_newer=over_newer)

    def validate_and_publish(self, version: str, *, log: Callable[[str], None] = _stderr
                             ) -> tuple[ValidationReport | None, PublishResult | None]:
        """Validates and, if it passes, publishes; `log` gets the validation table first.
        A version its name shows already is left as it is: (None, None)."""
        from batchline.publish.pointer import PublishResult

        with self._opened() as s:
            info = s.job(version)
            if info is not None and s.resolve_name(info.name) == version:
                log(PublishResult(info.name, version, version, ()).summary())
                return None, None
        report = self.validate(version)
        log(report.table())
        if not report.passed:
            raise BatchlineError(f"{version} failed validation; not published")
        return report, self.publish(version, log=log)

    def rollback(self, name: str, *, reason: str | None = None) -> tuple[str, str]:
        """Points `name` back at the version published before the current one: (from, to),
        never the current one itself; refused when there is none."""
        from batchline.publish.pointer import rollback

        with self._opened(lineage=True) as s:
            return rollback(s, name, reason)

    def cancel(self, version: str, *, reason: str | None = None) -> bool:
        """Ends a version nobody will publish (an input edited after planning, an engine that
        cannot load): no shard of it is claimed again and its workers leave it. Refused for
        the published version and the one a rollback would return to. False if it was
        cancelled already."""
        from batchline.store.model import who

        with self._opened(lineage=True) as s:
            return s.cancel(version, who(), reason)

    def resume(self, version: str, *, abort_dead_letter_rate: float | None = None,
               abort_min_outcomes: int | None = None, reason: str | None = None) -> DeadLetterBound:
        """Lifts the halt of a version whose dead letters passed its bound, under that bound or
        a new one (`abort_dead_letter_rate`, at least the version's
        validate.max_dead_letter_rate, 1 for never; `abort_min_outcomes`) that the store
        holds for it from now on; its workers may claim its shards again. Refused when the
        version is not halted, or when its dead letters pass the bound it would resume under.
        Returns that bound."""
        from batchline.spec import check_abort_rate, stored_spec
        from batchline.store.model import who

        if abort_dead_letter_rate is not None and not 0.0 <= abort_dead_letter_rate <= 1.0:
            raise BatchlineError(f"--abort-dead-letter-rate {abort_dead_letter_rate:g} is not a share between 0 and 1")
        if abort_min_outcomes is not None and abort_min_outcomes < 1:
            raise BatchlineError(f"--abort-min-outcomes {abort_min_outcomes} must be at least 1")
        with self._opened(lineage=True) as s:
            info = s.job(version)
            if info is not None and abort_dead_letter_rate is not None:
                def refuse(message: str) -> NoReturn:
                    raise BatchlineError(f"--abort-dead-letter-rate {message}")

                check_abort_rate(abort_dead_letter_rate, stored_spec(info).validate, refuse)
            return s.resume(version, who(), reason, abort_dead_letter_rate, abort_min_outcomes)

    def delete(self, version: str) -> bool:
        """Removes the rows of a cancelled version, or of a sealed one that is neither
        published nor what a rollback would return to nor read by a version not sealed yet
        (results a later version carries stay). False if it was removed already."""
        from batchline.publish.pointer import delete
        from batchline.store.model import who

        with self._opened() as s:
            return delete(s, version, who())

    # --- lineage -----------------------------------------------------------------------------

    def lineage(self, target: str | None = None, *, send: bool = False, retry: bool = False) -> LineageOutbox:
        """The lineage outbox (of one version or name, or all of it): each state change's event,
        sent, pending or given up. `retry`: rows given up on are due again; `send`: what is due
        is sent now, through this process's OpenLineage configuration (refused where none is)."""
        from batchline.lineage import lineage_config
        from batchline.lineage.drain import DrainReport, Sender, client_installed, drain_now

        config = lineage_config()
        if send and config is None:
            raise BatchlineError("lineage is off here: no openlineage.yml, OPENLINEAGE_URL or OPENLINEAGE__TRANSPORT "
                                 "variables configure a transport to send to")
        if send and not client_installed():
            raise BatchlineError("lineage needs openlineage-python to send: pip install 'batchline[lineage]'")
        with self._opened() as s:
            version = self._resolve(s, target) if target is not None else None
            retried = s.lineage_retry(version) if retry else 0
            report = drain_now(s, Sender(config), version=version) if send and config is not None else DrainReport()
            return LineageOutbox(s.lineage_rows(version), report.sent, report.failed, retried)

    # --- search ------------------------------------------------------------------------------

    def search(self, name: str, query: str, groups: Sequence[str] | Groups, *, k: int = 10,
               count_behind: bool = False) -> SearchResult:
        """The `k` records of the version published as `name` whose vectors are nearest the
        query's, among those whose ACL names one of `groups` exactly (a list of names: none,
        a bare string, or a group with padding or a control character is refused before
        anything is read). The query is embedded with the job's own pinned model, its
        weights' digest verified, so query and rows are vectors of one model; what is searched
        is the target of the job's spec that readers search (such as its `output.index`). Where the job reads a published job (`input.job`), each hit
        is also admitted by the ACL that job publishes now, so a revocation upstream is
        served nowhere from its publish on; `behind` says whether the version was planned on
        another upstream version than the one published now (`count_behind`: with the
        records that differ, a keyed join over both)."""
        from batchline.publish.search import search

        with self._opened() as s:
            return search(s, name, query, groups, k=k, count_behind=count_behind)

    # --- export and report -----------------------------------------------------------------------

    def export(self, target: str, *, format: ExportFormat = "jsonl", out: str | Path | None = None,
               errors: str | Path | None = None, partial: bool = False) -> ExportResult:
        """Writes the results of `target` (a version, or a published name) with each record's
        ACL in `format`, a member of the EXPORTS table (`batchline export --help` lists each with
        what it writes), to `out` (a file or folder, or an s3:// or gs:// URL where the format
        takes one; None: the format's default), and an error file at `errors` where the format
        writes one. A version that is not sealed yet is refused unless `partial` asks for the
        outcomes there are (a reader of a file cannot tell it is half)."""
        from batchline.registry import EXPORTS

        with self._opened() as s:
            exporter = EXPORTS.get(format)
            if exporter is None:
                raise BatchlineError(f"unknown export format {format!r}: {_choices(EXPORTS)}")
            chosen = exporter.load()
            if errors is not None and not chosen.errors_file:
                with_errors = [n for n, e in EXPORTS.items() if e.load().errors_file]
                raise BatchlineError(f"--errors goes with --format {' or '.join(with_errors)}")
            done: ExportResult = chosen.export(s, target, None if out is None else str(out),
                                               None if errors is None else str(errors), partial)
            return done

    def report(self, target: str, html: str | Path, *, gpu_hour_price: float | None = None) -> ReportData:
        """Writes one self-contained HTML page about a version (or a published name).
        `gpu_hour_price`: a spot worker-hour's price where the spec's fallback gives none
        (None: spot time is not priced)."""
        from batchline.ops.report.page import write_report

        with self._opened() as s:
            return write_report(s, target, Path(html), price=gpu_hour_price)


def _say_created(store: Store, log: Callable[[str], None]) -> None:
    """A store this command made is said once, by its path: a mistyped one is seen at once."""
    if store.created:
        log(f"created a new store at {store.where()}")


def _choices(table: Any) -> str:
    names = list(table)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _refuse_cancelled(s: Store, version: str) -> None:
    info = s.job(version)
    if info is not None and info.state in VersionEnded.ENDED_STATES:
        raise VersionEnded(version, info.state, s.where())


def _run_to_seal(s: Store, log: Callable[[str], None], job: JobSpec, workers: int) -> str:
    """`job` planned (or found) and run by `workers` local workers until it is sealed."""
    from batchline.ops.runner import LocalRunner, default_log_dir

    version = _plan_once(s, job, None, log).version
    _refuse_cancelled(s, version)
    info = s.job(version)
    if info is not None and info.state == "sealed":
        return version
    halt = s.halt_of(version)
    if halt is not None:
        raise VersionHalted(halt.message(version))
    log_dir = default_log_dir(s.url, version)
    with open(os.devnull, "w") as out:
        summary = LocalRunner(s, version, workers, out=out, log_dir=log_dir).run()
    info = s.job(version)
    if summary.exit_code != 0 or info is None or info.state != "sealed":
        state = info.state if info is not None else "gone"
        raise BatchlineError(f"{version} stopped before it was sealed ({state}, exit {summary.exit_code}; its "
                             f"workers' logs are in {log_dir}): validate again to continue it")
    return version


def _plan_once(s: Store, job: JobSpec, plan_key: str | None, log: Callable[[str], None]) -> PlanResult:
    """The version to run, and whether this call planned it: without a key, the job's
    version now; with one, the version the key names, planned and keyed here if none is."""
    from batchline.plan.planner import plan as plan_spec

    if plan_key is not None:
        keyed = s.keyed_version(job.name, plan_key)
        if keyed is not None:
            log(f"run {plan_key!r} of {job.name} was planned as {keyed}; running it")
            return _existing(s, job, keyed, log)
    planned = plan_spec(job, s, log=log)
    if plan_key is None:
        return planned
    keyed = s.key_plan(job.name, plan_key, planned.version)
    if keyed != planned.version:
        # Another slot of the same run planned first, from an older snapshot: its version is the run's.
        log(f"run {plan_key!r} of {job.name} was planned as {keyed} meanwhile; running it instead of "
            f"{planned.version}")
        if planned.created:
            from batchline.store.model import who

            s.cancel(planned.version, who(), f"run {plan_key!r} was keyed to {keyed} first")
        return _existing(s, job, keyed, log)
    return planned


def _existing(s: Store, job: JobSpec, version: str, log: Callable[[str], None]) -> PlanResult:
    """A version a key names, as a plan's result; its gate made the spec's, as planning it again
    would make it."""
    from batchline.plan.planner import PlanResult, keep_gate
    from batchline.store import require_job

    info = require_job(s, version)
    keep_gate(job, s, info, log)
    return PlanResult(version, False, info.record_count, info.shard_count, 0)


def __getattr__(name: str) -> Any:
    # The result types of the search and export ports, imported when first asked for, so that
    # importing the API stays cheap.
    if name == "SearchResult":
        from batchline.publish.search import SearchResult

        return SearchResult
    if name == "ExportResult":
        from batchline.targets.base import ExportResult

        return ExportResult
    raise AttributeError(f"module 'batchline.api' has no attribute {name!r}")
