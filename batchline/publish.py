"""Publishing: the pointer readers follow, its history, rollback and retention (I3)."""

from __future__ import annotations

import getpass
import socket
from collections.abc import Callable
from dataclasses import dataclass

from batchline.errors import BatchlineError
from batchline.spec import spec_from_store
from batchline.store import Store


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


def publish(store: Store, version: str, *, force: bool = False, reason: str | None = None,
            log: Callable[[str], None] = lambda _m: None) -> PublishResult:
    info = store.job(version)
    if info is None:
        raise BatchlineError(f"no job version {version!r} in {store.url}")
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
    previous = store.publish(info.name, version, who(), reason if force else None,
                             latest.report if latest else None)
    removed = prune(store, info.name, spec_from_store(info.spec).retention.versions, log=log)
    return PublishResult(info.name, version, previous, removed)


def rollback(store: Store, name: str, reason: str | None = None) -> tuple[str, str]:
    return store.rollback(name, who(), reason)


def prune(store: Store, name: str, keep: int, *, log: Callable[[str], None] = lambda _m: None) -> tuple[str, ...]:
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
        removed.append(job.version)
        log(f"removed {job.version} (retention keeps {keep} versions of {name})")
    return tuple(removed)
