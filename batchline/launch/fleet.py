"""A version's fleet launched once per scheduled task, and watched to its end: what an
orchestrator (`batchline.orchestrators`: Airflow, Dagster) does between planning a version
and validating it.

- `launch_once` writes the launch's intent in the store under the task's key, launches
  through a LAUNCHERS member (`local`, `kubernetes`, `ray`), and records what it launched;
  a retry of the task (the same key) finds the record and launches nothing again, and an
  intent left with nothing recorded (the task died between the two) is launched again
  idempotently: every launcher names what it starts after the key, so a second try finds
  the first's objects, submission or runner.
- `watch` is one poll of the version: running, sealed, halted or cancelled, with the
  pacer's `at risk` line where the version has a deadline; given the launch, also `gone`
  when its fleet is (`liveness`). It only reads the store and asks the launcher, so an
  orchestrator's trigger calls it in a thread and never blocks its event loop.
- `liveness` says of a launched fleet: `working` (a worker counts as the version's
  capacity: `live_capacity`, the one rule of what a heartbeat means), `starting` (none
  counts yet, and the launcher says what it started still runs, or cannot be asked from
  here and none has counted for less than `UNASKED_GONE_SECONDS`), or `gone` (none counts,
  and the launcher says nothing it started runs, or cannot be asked and none has counted for
  that long), with the reason. A lost fleet then fails the waiting task instead of leaving
  it waiting for ever; the version is left as it is (its leases expire, nothing is lost).
- A retry re-attaches only to a launch whose fleet the launcher does not say is gone: one
  it says is gone is recorded stopped (with why) and launched again under the same key.
- `stop_launched` stops what a launch started (its workers give their leases back, I5) and
  records the stop.
- `model_checks` names the gate's checks that run a model (`validate.reproduce`, and the
  graders that do): an orchestrator's worker has no model, so those are refused there
  before anything is launched.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchline.errors import BatchlineError, SpecError
from batchline.store import Store
from batchline.store.launches import LAUNCHED, STOPPED, LaunchRecord

RUNNING, SEALED, HALTED, CANCELLED, GONE = "running", "sealed", "halted", "cancelled", "gone"
WORKING, STARTING = "working", "starting"
# How long a fleet whose launcher cannot be asked from where the watcher runs (a Kubernetes
# launch watched without the cluster's API) may have no worker counted before it is gone:
# long enough for pods to be scheduled again after a preemption, or a new node to come.
UNASKED_GONE_SECONDS = 900.0


@dataclass(frozen=True)
class LaunchRequest:
    """What to launch for a version: its spec where the launcher reads it, the keys that make
    a retry find the first try's work, and the launcher's own options."""

    version: str
    spec: str  # the spec's path (local), or as the launcher's cluster reads it
    key: str  # the launch's key: the same on every retry of one task run
    plan_key: str  # the version's plan key: a runner that plans again finds this version
    store_url: str
    workers: int = 1
    deadline: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)


class Launcher(Protocol):
    """A LAUNCHERS member: places a version's workers somewhere, idempotently by the request's
    key, and stops them."""

    name: str
    options: Mapping[str, str]  # the options it takes, each with one line saying what it is

    def check(self, request: LaunchRequest) -> None:
        """Refuses, before anything is launched, a request it cannot carry out (one line)."""
        ...

    def launch(self, request: LaunchRequest) -> dict[str, Any]:
        """Starts the fleet, or finds the one this key started; what it started, as JSON."""
        ...

    def stop(self, request: LaunchRequest, detail: Mapping[str, Any]) -> None:
        """Stops what `launch` started (workers give their leases back)."""
        ...

    def running(self, request: LaunchRequest, detail: Mapping[str, Any]) -> bool | None:
        """Whether anything `launch` started still runs, as seen from here; None: it cannot be
        asked from here (a pid of another host, an API this process cannot reach)."""
        ...


def launcher(name: str) -> Launcher:
    """The LAUNCHERS member `name`; an unknown name is refused naming the known ones."""
    from batchline.registry import LAUNCHERS

    if name not in LAUNCHERS:
        raise SpecError(f"launcher {name!r} is not one of {', '.join(sorted(LAUNCHERS))}")
    member: Launcher = LAUNCHERS[name].load()
    return member


def checked(name: str, request: LaunchRequest) -> Launcher:
    """The launcher, with the request's options checked: an option it does not take is refused
    (a typo is an error, not a default), then the launcher's own checks."""
    chosen = launcher(name)
    unknown = sorted(set(request.options) - set(chosen.options))
    if unknown:
        known = ", ".join(sorted(chosen.options)) or "none"
        raise SpecError(f"launcher {name}: option {unknown[0]!r} is not one it takes ({known})")
    if request.workers < 1:
        raise SpecError(f"launcher {name}: workers must be at least 1, not {request.workers}")
    chosen.check(request)
    return chosen


@dataclass(frozen=True)
class Launched:
    record: LaunchRecord
    launched_now: bool  # False: a retry re-attached to what an earlier try launched


def launch_once(store: Store, request: LaunchRequest, name: str, by: str) -> Launched:
    """Launches the version's fleet unless the key launched it already (see the module)."""
    chosen = checked(name, request)
    record, _made = store.launch_intent(request.version, request.key, name, by)
    if (record.state == LAUNCHED and record.detail is not None and _open(store, request.version)
            and chosen.running(request, record.detail) is False):
        # The earlier try's fleet is gone: recorded as such, and launched again under the key.
        store.launch_stopped(request.version, request.key, f"its fleet was gone when {by} tried again")
        record, _made = store.launch_intent(request.version, request.key, name, by)
    if record.state == LAUNCHED:
        return Launched(record, False)
    detail = chosen.launch(request)
    return Launched(store.launch_recorded(request.version, request.key, detail), True)


def _open(store: Store, version: str) -> bool:
    info = store.job(version)
    return info is not None and info.state == "ready"


def _launch_of(store: Store, request: LaunchRequest) -> LaunchRecord | None:
    """The launch record of the request's key, or None."""
    return next((r for r in store.launches(request.version) if r.key == request.key), None)


def stop_launched(store: Store, request: LaunchRequest, reason: str) -> LaunchRecord | None:
    """Stops what the key launched and records why; None when it launched nothing."""
    record = _launch_of(store, request)
    if record is None or record.state == STOPPED:
        return record
    if record.detail is not None:
        launcher(record.launcher).stop(request, record.detail)
    return store.launch_stopped(request.version, request.key, reason)


@dataclass(frozen=True)
class Liveness:
    state: str  # working, starting, gone
    reason: str  # one line
    # Since when (the store's clock) no worker has counted, in a row; None while one does.
    quiet_since: float | None = None
    launcher: str | None = None  # the launch's launcher, once it is recorded


def liveness(store: Store, request: LaunchRequest, quiet_since: float | None) -> Liveness:
    """Where the fleet of the launch `request.key` is (see the module). `quiet_since`: what the
    watcher's previous poll said (`Liveness.quiet_since`), or None."""
    live = store.live_capacity(request.version)
    if live:
        return Liveness(WORKING, f"{len(live)} worker{'s' if len(live) != 1 else ''} counted")
    now = store.now()
    quiet_since = now if quiet_since is None else quiet_since
    record = _launch_of(store, request)
    if record is None or record.state != LAUNCHED or record.detail is None:
        return Liveness(STARTING, "its launch is not recorded yet", quiet_since)
    name = record.launcher
    running = launcher(name).running(request, record.detail)
    if running:
        return Liveness(STARTING, f"no worker counted yet; the {name} launcher says its fleet runs", quiet_since, name)
    if running is False:
        return Liveness(GONE, f"no worker has been heard within the heartbeat bound and the {name} launcher says "
                              f"nothing it started runs{_last_words(record.detail)}", quiet_since, name)
    quiet = now - quiet_since
    if quiet < UNASKED_GONE_SECONDS:
        return Liveness(STARTING, f"no worker counted for {quiet:.0f} s; the {name} launcher cannot be asked from "
                                  f"here", quiet_since, name)
    return Liveness(GONE, f"no worker counted for {quiet:.0f} s (at most {UNASKED_GONE_SECONDS:.0f} s while its "
                          f"{name} launcher cannot be asked from here)", quiet_since, name)


def _last_words(detail: Mapping[str, Any]) -> str:
    """Where a local runner's log is, and its last line (what it said as it ended)."""
    log = detail.get("log")
    if not isinstance(log, str):
        return ""
    last = ""
    with contextlib.suppress(OSError), open(log, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 4096))
        lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
        last = lines[-1].strip()[:300] if lines else ""
    return f"; the runner's log is {log}" + (f", its last line: {last}" if last else "")


@dataclass(frozen=True)
class Watch:
    """One poll of a version."""

    version: str
    state: str  # running, sealed, halted, cancelled
    message: str  # one line
    records: int
    results: int
    dead_letters: int
    at_risk: str | None = None  # the pacer's line, while its deadline is at risk
    fleet: str | None = None  # its fleet's liveness where the launch was given: working, starting, gone
    # Since when (the store's clock) no worker of it has counted, in a row: the next poll's `quiet_since`.
    quiet_since: float | None = None

    @property
    def done(self) -> bool:
        return self.state != RUNNING

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "state": self.state, "message": self.message, "records": self.records,
                "results": self.results, "dead_letters": self.dead_letters, "at_risk": self.at_risk,
                "fleet": self.fleet, "quiet_since": self.quiet_since}


def watch(store: Store, version: str, request: LaunchRequest | None = None,
          quiet_since: float | None = None) -> Watch:
    """Where the version is now (see the module); reads only (and asks the launcher of
    `request`'s launch, where given, whether its fleet runs)."""
    from batchline.store import require_job

    info = require_job(store, version)
    st = store.status(version)
    counts = (st.records, st.results, st.dead_letters)
    if info.state == "sealed":
        return Watch(version, SEALED, f"{version} is sealed: {st.results:,} results, {st.dead_letters:,} dead letters",
                     *counts)
    if info.state == "cancelled":
        return Watch(version, CANCELLED, f"{version} was cancelled", *counts)
    halt = store.halt_of(version)
    if halt is not None:
        return Watch(version, HALTED, halt.message(version), *counts)
    done = st.results + st.dead_letters
    fleet: Liveness | None = None
    if request is not None:
        fleet = liveness(store, request, quiet_since)
        quiet_since = fleet.quiet_since
        if fleet.state == GONE:
            return Watch(version, GONE, f"{version}: its fleet is gone ({fleet.launcher} launch): {fleet.reason}; "
                         f"{done:,} of {st.records:,} records answered, the rest wait for a new launch", *counts,
                         fleet=GONE, quiet_since=quiet_since)
    return Watch(version, RUNNING, f"{version}: {done:,} of {st.records:,} records answered", *counts,
                 at_risk=_at_risk(store, version), fleet=fleet.state if fleet is not None else None,
                 quiet_since=quiet_since)


def news(before: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[tuple[bool, str]]:
    """What a watcher says of a poll (`Watch.to_json`) that it had not said of the one before:
    the records answered, when they moved, and the deadline's `at risk` line, when it came or
    changed (a warning). At most one line of each a poll, none while nothing changed."""
    said: list[tuple[bool, str]] = []
    counts = ("results", "dead_letters")
    if now["state"] == RUNNING and (before is None or any(before[k] != now[k] for k in counts)):
        dead = f" ({now['dead_letters']:,} dead letters)" if now["dead_letters"] else ""
        said.append((False, f"{now['message']}{dead}"))
    if now["at_risk"] is not None and (before is None or before["at_risk"] != now["at_risk"]):
        said.append((True, f"{now['version']}: deadline at risk: {now['at_risk']}"))
    return said


def poll(store_url: str, version: str, request: LaunchRequest | None = None,
         quiet_since: float | None = None) -> Watch:
    """`watch` over a store opened for this one poll."""
    from batchline.store import open_store

    with contextlib.closing(open_store(store_url, create=False)) as store:
        return watch(store, version, request, quiet_since)


def wait(store_url: str, version: str, poll_seconds: float, log: Callable[[str], None],
         max_failures: int = 10, request: LaunchRequest | None = None) -> Watch:
    """Polls the version until it ends, in this process (an orchestrator that cannot defer):
    says in `log` what `news` says of each poll; a store unreadable `max_failures` polls in a
    row is refused naming it, the version and its workers untouched."""
    failures = 0
    before: dict[str, Any] | None = None
    quiet: float | None = None
    while True:
        try:
            state = poll(store_url, version, request, quiet)
        except (BatchlineError, OSError) as exc:
            failures += 1
            if failures >= max_failures:
                raise BatchlineError(f"the batchline store could not be read {failures} times in a row: "
                                     f"{' '.join(str(exc).split())}; {version} and its workers are untouched") from None
            time.sleep(poll_seconds)
            continue
        failures = 0
        now = state.to_json()
        for _warning, line in news(before, now):
            log(line)
        before, quiet = now, state.quiet_since
        if state.done:
            return state
        time.sleep(poll_seconds)


def _at_risk(store: Store, version: str) -> str | None:
    from batchline.launch.pacer import Pacer
    from batchline.sizing.pacing import Mode

    # A deadline's picture is advice: a version whose pacing cannot be read is still watched.
    with contextlib.suppress(BatchlineError):
        pacer = Pacer.watching(store, version)
        picture = pacer.picture() if pacer is not None else None
        if picture is not None and picture.decision.mode is Mode.AT_RISK:
            return picture.line()
    return None


def model_checks(spec: Any) -> list[str]:
    """The gate's checks of a spec that run a model (`validate.KEY`), in the spec's order."""
    from batchline.registry import GRADERS, keyed

    members = keyed(GRADERS)
    named = [f"validate.{g.key}" for g in spec.validate.graders if getattr(members.get(g.key), "runs_model", False)]
    return (["validate.reproduce"] if spec.validate.reproduce is not None else []) + named


def manifest(store: Store, version: str, published_as: str | None) -> dict[str, Any]:
    """What an orchestrator passes on about a version (an XCom, an asset's metadata): a few
    figures and where it was published, never results. `results` is `computed` plus
    `carried` (from the version's base, unchanged); `targets`, where it was published, one
    entry each: the store's view, then each target as its publication recorded it (`kind`,
    where it is, and what it showed readers: a version folder, a snapshot id, a tag)."""
    from batchline.store import require_job

    info = require_job(store, version)
    st = store.status(version)
    tokens = store.token_totals(version)
    computed = sum(t.results for t in store.route_totals(version).values())
    # What paid workers a pacer bought cost (the fallback's price); spot capacity is not priced.
    paid_cost, _rate = store.paid_budget(version)
    return {"version": version, "name": info.name, "state": info.state, "records": st.records,
            "results": st.results, "computed": computed, "carried": st.results - computed,
            "dead_letters": st.dead_letters, "input_tokens": tokens[0], "output_tokens": tokens[1],
            "paid_worker_seconds": round(store.paid_spend_seconds(version), 1), "paid_cost": round(paid_cost, 4),
            "published_as": published_as, "targets": published_targets(store, published_as, version)}


def published_targets(store: Store, name: str | None, version: str) -> list[dict[str, Any]]:
    """Where `version` is published as `name`, structured: the store's view, and what each
    target showed after the publication that made it current (by the target's key, `KIND:WHERE`)."""
    if name is None:
        return []
    entries: list[dict[str, Any]] = [{"kind": "view", "name": name, "version": version}]
    history = store.publications(name)
    if history and history[-1].version == version:
        for key, state in sorted((history[-1].targets or {}).items()):
            kind, _, where = key.partition(":")
            entries.append({"kind": kind, "location": where, **(state if isinstance(state, dict) else {})})
    return entries
