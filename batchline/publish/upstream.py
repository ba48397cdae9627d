"""A job over a published job, and the upstream it follows: whose ACLs are served now (I6).

A downstream version (an embedding job over `input.job`) copies its upstream's
records, ACLs included, when it is planned. Its own rows (the store's, an export's,
an index's) keep that copy until it runs again, but what a search serves follows
the ACL that the upstream publishes *now*:

- `CurrentAcls` holds, for a downstream version, the chain of upstreams it reads
  (an upstream may itself read a published job), each resolved to the version
  published now. `admitted` checks a batch of candidate records against each
  level's results by key (one read per level and batch), and admits a record only
  where every level has a result for it whose ACL admits the caller (`acl.admits`):
  a record the upstream no longer publishes, or published under an ACL that
  excludes the caller, is withheld. A revocation so takes effect at the upstream's
  publish, whatever the downstream has run since, and also after the downstream
  is rolled back to a version planned on an older upstream.
- When an upstream's current publication cannot be read (nothing is published
  under its name, its version is gone), nothing is served: `UpstreamUnreadable`
  names the job to publish or re-run. That is the only case that fails closed for
  the whole search; a lagging downstream stays searchable.
- `lag` says how far a version is behind its upstream (the version it was planned
  on against the one published now, and how many records differ); `readers_behind`
  names the published jobs that read an older version of a name, which its publish
  reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchline.acl import Groups, admits
from batchline.errors import StoreError
from batchline.sources import published_read
from batchline.store import JobInfo, ReaderStore, ResultChanges

# A chain of jobs over jobs longer than this is refused rather than walked: planning
# pins each level, so a chain cannot loop, and none this deep is meant.
MAX_CHAIN = 16


class UpstreamUnreadable(StoreError):
    """The ACLs an upstream publishes now cannot be read: a search that would serve its
    records serves none of them."""


@dataclass(frozen=True)
class Level:
    """One upstream a version's records follow: its name, the version the reader was
    planned on, and the version published under the name now."""

    name: str
    planned_on: str | None
    published: str


@dataclass(frozen=True)
class UpstreamLag:
    """How a version stands against one upstream it reads."""

    reader: str  # the version that reads it
    name: str
    planned_on: str | None
    published: str | None  # None: nothing is published under the name now
    changes: ResultChanges | None = None  # counted where asked

    @property
    def behind(self) -> bool:
        return self.planned_on != self.published

    def describe(self) -> str:
        if not self.behind:
            return f"reads {self.planned_on} of {self.name}, published now"
        now = self.published or "nothing"
        counted = f" ({self.changes.describe()} differ)" if self.changes is not None else ""
        return f"behind its upstream {self.name}: planned on {self.planned_on}, {now} is published now{counted}"

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"upstream": self.name, "planned_on": self.planned_on,
                                  "published": self.published, "behind": self.behind}
        if self.changes is not None:
            out["records"] = self.changes.total
            out["changes"] = self.changes.__dict__
        return out


def _reads(info: JobInfo) -> list[tuple[str, str | None]]:
    return published_read(info.spec.get("input", {}))


def lag(store: ReaderStore, info: JobInfo, *, count: bool = False) -> list[UpstreamLag]:
    """How `info`'s version stands against each upstream it reads (none: it reads no
    published job); `count`: with the records that differ between the two upstream
    versions (a keyed join over both, so only where asked)."""
    out = []
    for name, planned in _reads(info):
        published = store.resolve_name(name)
        changes = None
        if count and planned is not None and published is not None and planned != published \
                and store.job(planned) is not None:
            changes = store.result_changes(planned, published)
        out.append(UpstreamLag(info.version, name, planned, published, changes))
    return out


def readers_behind(store: ReaderStore, name: str, version: str) -> list[UpstreamLag]:
    """The published versions of other names that read `name` at another version than
    `version`: their tables, exports and views lag until they run again."""
    out = []
    for reader_name, reader_version in sorted(store.published().items()):
        info = store.job(reader_version)
        if info is None or reader_name == name:
            continue
        for upstream, planned in _reads(info):
            if upstream == name and planned != version:
                out.append(UpstreamLag(reader_version, name, planned, version))
    return out


class CurrentAcls:
    """The ACLs a downstream version's records carry now: its upstreams' current publications."""

    def __init__(self, reader: str, levels: Sequence[Level], store: ReaderStore) -> None:
        self.reader = reader
        self.levels = tuple(levels)
        self.store = store
        self.withheld = 0  # candidates `admitted` has refused so far

    @classmethod
    def of(cls, store: ReaderStore, info: JobInfo) -> CurrentAcls | None:
        """The chain `info`'s version follows, each level resolved now; None where it reads no
        published job (its own rows' ACLs are then the input's, as planned). Refused with
        `UpstreamUnreadable` where a level's publication cannot be read."""
        levels: list[Level] = []
        at = info
        while True:
            reads = _reads(at)
            if not reads:
                break
            for name, planned in reads:
                published = store.resolve_name(name)
                job = store.job(published) if published is not None else None
                if published is None or job is None or job.state != "sealed":
                    what = (f"nothing is published as {name!r}" if published is None
                            else f"{published}, published as {name!r}, is not readable in the store")
                    raise UpstreamUnreadable(
                        f"{info.name} serves the records of {name} under the ACLs {name} publishes now, and {what} "
                        f"in {store.where()}: nothing is served until {name} is published again (then re-run "
                        f"{info.name} over it)")
                levels.append(Level(name, planned, published))
                if len(levels) > MAX_CHAIN:
                    raise UpstreamUnreadable(f"{info.name} reads a chain of more than {MAX_CHAIN} published jobs")
                at = job
        return cls(info.version, levels, store) if levels else None

    def admitted(self, record_ids: Sequence[str], groups: Groups) -> set[str]:
        """The records among `record_ids` that every upstream's current publication holds
        under an ACL admitting `groups`."""
        left = list(dict.fromkeys(record_ids))
        for level in self.levels:
            if not left:
                break
            acls = self.store.result_acls(level.published, left)
            left = [rid for rid in left if rid in acls and admits(acls[rid], groups)]
        self.withheld += len(set(record_ids)) - len(left)
        return set(left)
