"""Publishing: the pointer readers follow, its history, rollback and retention (I3)."""

from __future__ import annotations

import getpass
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchline.errors import BatchlineError
from batchline.spec import stored_spec
from batchline.store import PublisherStore
from batchline.targets import PublicationTarget


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class PublishResult:
    name: str
    version: str
    previous: str | None
    removed: tuple[str, ...]


def publish(store: PublisherStore, version: str, *, force: bool = False, reason: str | None = None,
            log: Callable[[str], None] = lambda _m: None,
            targets: Sequence[PublicationTarget] = ()) -> PublishResult:
    """Moves the name's pointer to `version` once it is sealed and validated; each target
    first gets the version staged, then shown once the pointer has moved."""
    info = store.job(version)
    if info is None:
        raise BatchlineError(f"no job version {version!r} in {store.url}")
    if info.state == "cancelled":
        raise BatchlineError(f"{version} was cancelled: a cancelled version is never published")
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
    for target in targets:
        target.stage(store, version)
    shown = _show(store, info.name, version, targets)
    previous = store.publish(info.name, version, who(), reason if force else None,
                             latest.report if latest else None, targets=shown or None)
    removed = prune(store, info.name, stored_spec(info).retention.versions, log=log, targets=targets)
    return PublishResult(info.name, version, previous, removed)


def rollback(store: PublisherStore, name: str, reason: str | None = None,
             targets: Sequence[PublicationTarget] = ()) -> tuple[str, str]:
    if not targets:
        return store.rollback(name, who(), reason)
    current = store.resolve_name(name)
    back_to = next((p.previous for p in reversed(store.publications(name))
                    if p.version == current and p.action == "publish"), None)
    if current is None or back_to is None:
        return store.rollback(name, who(), reason)  # refused there, in the store's words
    for target in targets:
        target.stage(store, back_to)  # staged when it was published, unless the target is new
    shown = _show(store, name, back_to, targets)
    moved = store.rollback(name, who(), reason, targets=shown)
    if moved != (current, back_to):
        raise BatchlineError(f"{name}: another publish moved it meanwhile ({moved[0]} to {moved[1]}); the "
                             f"targets show {back_to}: publish again to bring them in line")
    return moved


def _show(store: PublisherStore, name: str, version: str,
          targets: Sequence[PublicationTarget]) -> dict[str, Any]:
    """Shows `version` in each target, from the state the store recorded last for it."""
    recorded: dict[str, Any] = {}
    for pub in store.publications(name):
        recorded.update(pub.targets or {})
    return {t.key: t.show(name, version, recorded.get(t.key)) for t in targets}


def prune(store: PublisherStore, name: str, keep: int, *, log: Callable[[str], None] = lambda _m: None,
          targets: Sequence[PublicationTarget] = ()) -> tuple[str, ...]:
    """Removes sealed versions of `name` beyond the newest `keep`, never the published
    one or the one a rollback would return to."""
    current = store.resolve_name(name)
    history = store.publications(name)
    protected = {current}
    for pub in reversed(history):
        if pub.version == current:
            protected.add(pub.previous)
            break
    versions = sorted((j for j in store.jobs() if j.name == name), key=lambda j: j.created_at, reverse=True)
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
