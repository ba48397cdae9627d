"""Publishing: the pointer readers follow, its history, rollback and retention (I3)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchline.errors import BatchlineError, PointerMovedOn, StoreError
from batchline.publish.upstream import UpstreamLag, readers_behind
from batchline.sources import versions_read
from batchline.spec import JobVersion, stored_spec
from batchline.store import PublisherStore
from batchline.store.model import JobInfo, PointerAt, Publication, rollback_target, who
from batchline.targets import PublicationTarget, targets_for


@dataclass(frozen=True)
class PublishResult:
    name: str
    version: str
    previous: str | None
    removed: tuple[str, ...]
    shown: tuple[str, ...] = ()  # each target, as it now shows the version
    restaged: tuple[str, ...] = ()  # published already: the targets whose data was missing, written back
    # The published versions of other names that read this name at another version (input.job):
    # their own tables and exports lag until they run again.
    readers_behind: tuple[UpstreamLag, ...] = ()

    @property
    def changed(self) -> bool:
        """False when the version was published already: nothing moved, nothing recorded."""
        return self.previous != self.version

    def summary(self) -> str:
        if not self.changed:
            if self.restaged:
                return (f"{self.version} is published as {self.name} already; re-staged what was missing: "
                        + "; ".join(self.restaged))
            return f"{self.version} is published as {self.name} already; nothing changed"
        lines = [f"published {self.version} as {self.name}" + (f" (was {self.previous})" if self.previous else "")]
        lines += [f"  {line}" for line in self.shown]
        for lag in self.readers_behind:
            reader_name = lag.reader.split("@", 1)[0]
            lines.append(f"  {reader_name} ({lag.reader}) reads {lag.planned_on} of {self.name}: its searches follow the "
                         f"ACLs published now; run it again so its own tables and exports do too")
        return "\n".join(lines)


def publish(store: PublisherStore, version: str, *, force: bool = False, reason: str | None = None,
            log: Callable[[str], None] = lambda _m: None,
            targets: Sequence[PublicationTarget] | None = None, since: PointerAt | None = None,
            over_newer: str | None = None) -> PublishResult:
    """Moves the name's pointer to `version` once it is sealed and validated; each target
    (by default those the version's spec names) first gets the version staged, then
    shown, and the store records what each shows as it moves the pointer. A store
    that refuses puts the targets back. The version published already is left as it
    is, and nothing is recorded (the result's `changed` is False): each target is staged
    again, which writes back what was removed from under it (`restaged`). The version's
    record and spec are read once, here, and each target is handed them. `since`: where the
    name's pointer was when a scheduled run first planned the version; the publish is refused
    (`PointerMovedOn`) if it moved since, unless `over_newer` says why it goes on anyway (kept
    in the history as the publication's reason)."""
    job = JobVersion.of(store, version)
    info = job.info
    if info.state == "cancelled":
        raise BatchlineError(f"{version} was cancelled: a cancelled version is never published")
    if targets is None:
        targets = targets_for(job.spec, store.url)
    if info.state != "sealed":
        raise BatchlineError(f"{version} is not sealed: only a finished, validated version is published")
    if force and not reason:
        raise BatchlineError("--force needs --reason: why publish without a passing validation?")
    latest = store.latest_validation(version)
    if not force:
        if latest is None:
            raise BatchlineError(f"{version} has not been validated: run `batchline validate {version}` first")
        if not latest.passed:
            failed = ", ".join(c["name"] for c in latest.report.get("checks", []) if not c["passed"])
            raise BatchlineError(f"{version} failed its latest validation ({failed}); "
                                 "fix it, or publish with --force --reason")
    _claim(info.name, targets, store)
    history = store.publications(info.name)
    if history and history[-1].version == version:
        # Published already: nothing is moved and history records nothing, once the store has
        # confirmed, under the name's lock, that no publisher moved it since. Each target is
        # staged again, which writes nothing where the version is there (a table removed
        # meanwhile is written back, so publishing again repairs it).
        store.publish(info.name, version, who(), None, None, expected=history[-1].id)
        restaged = tuple(t.describe() for t in targets if t.stage(store, job))
        return PublishResult(info.name, version, version, (), restaged=restaged)
    _refuse_moved(info.name, version, history, since, over_newer)
    for target in targets:
        target.stage(store, job)
    # What the name's history is before any target moves: the store records this publish
    # only if it is still its latest publication when the pointer moves, so two
    # publishers of one name never leave the targets showing one version and the store
    # another. The store's lock is not held meanwhile: a catalog in the store's own
    # database (SQLite's one writer) could not commit under it.
    history = store.publications(info.name)
    moved_over = _refuse_moved(info.name, version, history, since, over_newer)  # on the read the store checks
    expected = history[-1].id if history else None
    recorded = _recorded(history)
    shown = _show(info.name, version, targets, recorded)
    why = reason if force else (f"published over {moved_over.version}: {over_newer}" if moved_over else None)
    try:
        previous = store.publish(info.name, version, who(), why,
                                 latest.report if latest else None, expected=expected, targets=shown or None)
    except BaseException as exc:
        _put_back(info.name, targets, shown, recorded, exc)
        raise
    removed: tuple[str, ...] = ()
    if previous != version:  # the store says `version` itself when another publisher published it meanwhile
        removed = prune(store, info.name, job.spec.retention.versions, log=log, targets=targets)
    return PublishResult(info.name, version, previous, removed,
                         tuple(f"{t.describe()}: {_state_line(shown.get(t.key))}" for t in targets),
                         readers_behind=tuple(readers_behind(store, info.name, version)))


def _refuse_moved(name: str, version: str, history: Sequence[Publication], since: PointerAt | None,
                  over_newer: str | None) -> Publication | None:
    """Refuses a scheduled run's publish whose name's pointer moved since the run planned;
    with `over_newer`, the publication it goes over instead."""
    moved = since.moved(history) if since is not None else None
    if moved is None or over_newer:
        return moved
    raise PointerMovedOn(f"{name} moved on since the run that planned {version} began: it now shows {moved.version} "
                         f"({moved.action} by {moved.who}), so {version} is validated but not published over it; "
                         f"publish it explicitly (with a reason) to do so")


def _state_line(state: dict[str, Any] | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (state or {}).items())


def rollback(store: PublisherStore, name: str, reason: str | None = None,
             targets: Sequence[PublicationTarget] | None = None) -> tuple[str, str]:
    """Points `name` back at the version published before the current one, and each
    target (by default those the current version's spec names) with it."""
    # The same compare-and-set as publish: the current version, the one to return to and
    # what the targets show all come from this one read of the history.
    history = store.publications(name)
    expected = history[-1].id if history else None
    current = history[-1].version if history else None
    if targets is None:
        info = store.job(current) if current is not None else None
        targets = targets_for(stored_spec(info), store.url) if info is not None else []
    back_to = rollback_target(history, current)
    if current is None or back_to is None or not targets:
        return store.rollback(name, who(), reason, expected=expected)  # refused there, in the store's words
    returning = JobVersion.of(store, back_to)
    _claim(name, targets, store)
    for target in targets:
        target.stage(store, returning)  # staged when it was published, unless the target is new
    recorded = _recorded(history)
    shown = _show(name, back_to, targets, recorded)
    try:
        # The store, finding the history as read, returns to the same version by the same rule.
        return store.rollback(name, who(), reason, expected=expected, targets=shown)
    except BaseException as exc:
        _put_back(name, targets, shown, recorded, exc)
        raise


def _claim(name: str, targets: Sequence[PublicationTarget], store: PublisherStore) -> None:
    """Each target records `store` as the one that publishes into it, or refuses another's,
    before anything is written anywhere."""
    for target in targets:
        if not callable(getattr(target, "claim", None)):
            # A plug-in written before targets had owners: refused, not published unowned.
            raise BatchlineError(f"{target.describe()}: its target does not say which store publishes into it "
                                 f"(`claim`, see the extending page); nothing was published")
        target.claim(name, store)


def _recorded(history: Sequence[Publication]) -> dict[str, Any]:
    """What each target showed after the last publication that recorded it."""
    recorded: dict[str, Any] = {}
    for pub in history:
        recorded.update(pub.targets or {})
    return recorded


def _show(name: str, version: str, targets: Sequence[PublicationTarget],
          recorded: dict[str, Any]) -> dict[str, Any]:
    """Shows `version` in each target, from the state the store recorded last for it;
    when one refuses, those already shown are put back."""
    shown: dict[str, Any] = {}
    for target in targets:
        try:
            shown[target.key] = target.show(name, version, recorded.get(target.key))
        except BaseException as exc:
            _put_back(name, targets, shown, recorded, exc)
            raise
    return shown


def _put_back(name: str, targets: Sequence[PublicationTarget], shown: dict[str, Any],
              recorded: dict[str, Any], cause: BaseException) -> None:
    """Puts each target that was shown back to what the store recorded: the store did not
    record this publish (it failed, or another publisher of the name came in between), so
    no target may show it. A target that cannot be put back is said in one line."""
    failed = []
    for target in targets:
        if target.key not in shown:
            continue
        try:
            target.restore(name, recorded.get(target.key), shown[target.key])
        except Exception as exc:
            failed.append(f"{target.describe()} could not be put back ({' '.join(str(exc).split())})")
    if failed:
        raise BatchlineError(f"{' '.join(str(cause).split()) or type(cause).__name__}; and "
                             + "; ".join(failed) + ": it now shows what the store did not record") from cause


def readers_not_sealed(jobs: Sequence[JobInfo]) -> dict[str, str]:
    """Each version that a version not sealed yet reads (a job over a job, planned on it),
    with one such reader: what neither retention nor `delete` removes."""
    # A halted version is not sealed yet either: it runs again once it is resumed.
    return {read: j.version for j in jobs if j.state in ("planning", "ready", "halted")
            for read in versions_read(j.spec.get("input", {}))}


def delete(store: PublisherStore, version: str, who: str) -> bool:
    """`store.delete`, refused while a version not sealed yet reads this one."""
    reader = readers_not_sealed(store.jobs()).get(version)
    if reader is not None:
        raise StoreError(f"cannot delete {version}: {reader} reads it (input.job) and is not sealed yet; "
                         f"let it seal, or cancel it, first")
    return store.delete(version, who)


def prune(store: PublisherStore, name: str, keep: int, *, log: Callable[[str], None] = lambda _m: None,
          targets: Sequence[PublicationTarget] = ()) -> tuple[str, ...]:
    """Removes sealed versions of `name` beyond the newest `keep`, never the published
    one, the one a rollback would return to, or one that a version not sealed yet reads
    (a job over this one, planned on it)."""
    current = store.resolve_name(name)
    history = store.publications(name)
    protected = {current, rollback_target(history, current)}
    jobs = store.jobs()
    protected.update(readers_not_sealed(jobs))
    versions = sorted((j for j in jobs if j.name == name), key=lambda j: j.created_at, reverse=True)
    removed = []
    for job in versions[keep:]:
        if job.version in protected or job.state != "sealed":
            continue
        store.remove_version(job.version)
        for target in targets:
            target.forget(name, job.version)
        removed.append(job.version)
        log(f"removed {job.version} (retention keeps {keep} versions of {name})")
    return tuple(removed)
