"""A searchable target that exists only in the tests: an in-memory index, searched exactly.

It is not built on Lance or on anything of `batchline.targets.lancedb_index`: it fills the
search port (`batchline.targets.base.Searchable`) from scratch, owns its output key
(`output.memory_index`), and is added to the TARGETS table through `batchline.registry.register`
as a plug-in outside batchline would be. `batchline search` and `Jobs.search` find it by what
the published version's spec names, with no change to either; that is what it proves.

Its rows live in this process (`ROWS`, by job name and version), staged from the store's
results when a version is published; a search ranks every row the caller's groups may see
by cosine similarity, through the one rule of `batchline.acl`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from batchline.acl import Acl, Groups, admits
from batchline.errors import BatchlineError
from batchline.registry import TARGETS, Plugin, register, unregister
from batchline.sources.base import DatasetName, StoreDatasets
from batchline.spec import JobSpec, JobVersion
from batchline.spec.reader import Fields, ParseContext, SpecReader
from batchline.store import ReaderStore
from batchline.targets.base import Admit, Answer, Hit, PublisherWritten, Searchable, TargetFamily

KEY = "memory_index"
# (job name, version) -> record id -> (vector, ACL, chosen fields)
ROWS: dict[tuple[str, str], dict[str, tuple[list[float], Acl | None, dict[str, Any]]]] = {}
SEARCHES: list[str] = []  # the versions searched, in order


@dataclass
class MemoryIndex:
    output: MemoryIndexOutput

    @property
    def key(self) -> str:
        return "memory"

    def describe(self) -> str:
        return "in-memory index"

    def claim(self, name: str, store: Any) -> None:
        return None  # one process's memory: no other store can reach it

    def stage(self, store: ReaderStore, job: JobVersion) -> bool:
        if (job.name, job.version) in ROWS:
            return False
        rows = {}
        for r in store.iter_results(job.version):
            out = orjson.loads(r.output)
            rows[r.record_id] = ([float(v) for v in out[self.output.vector_field]], r.acl,
                                 {f: out.get(f) for f in self.output.fields})
        ROWS[(job.name, job.version)] = rows
        return True

    def show(self, name: str, version: str, recorded: dict[str, Any] | None) -> dict[str, Any]:
        return {"version": version}

    def restore(self, name: str, recorded: dict[str, Any] | None, shown: dict[str, Any]) -> None:
        return None

    def forget(self, name: str, version: str) -> None:
        ROWS.pop((name, version), None)


@dataclass(frozen=True)
class MemoryIndexOutput(PublisherWritten, Searchable):
    vector_field: str = "embedding"
    fields: tuple[str, ...] = ()

    def describe(self) -> str:
        return "in-memory index"

    def to_dict(self) -> dict[str, Any]:
        return {KEY: {"vector_field": self.vector_field, "fields": list(self.fields)}}

    def target(self, store_url: str | None, storage: Mapping[str, Any]) -> MemoryIndex:
        return MemoryIndex(self)

    def check(self, spec: JobSpec, store_url: str | None) -> None:
        return None

    def dataset(self, name: str, store: StoreDatasets, state: Mapping[str, Any] | None) -> DatasetName:
        return DatasetName("memory", name, (state or {}).get("version"))

    def query_vector(self, output: str) -> list[float]:
        return [float(v) for v in orjson.loads(output)[self.vector_field]]

    def search(self, name: str, version: str, vector: Sequence[float], groups: Groups, k: int, *,
               storage: Mapping[str, Any], admit: Admit | None = None) -> Answer:
        rows = ROWS.get((name, version))
        if rows is None:
            raise BatchlineError(f"the in-memory index has no {version}")
        SEARCHES.append(version)
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0

        def score(row: list[float]) -> float:
            return sum(a * b for a, b in zip(vector, row, strict=True)) / (
                norm * (math.sqrt(sum(v * v for v in row)) or 1.0))

        visible = sorted(((score(vec), rid) for rid, (vec, acl, _f) in rows.items() if admits(acl, groups)),
                         key=lambda sr: (-sr[0], sr[1]))
        allowed = admit([rid for _s, rid in visible]) if admit is not None else {rid for _s, rid in visible}
        kept = [(s, rid) for s, rid in visible if rid in allowed]
        return Answer([Hit(rid, s, rows[rid][2], version) for s, rid in kept[:k]], "memory-exact",
                      len(visible) - len(kept))


class MemoryIndexFamily(TargetFamily):
    name = "memory"
    searchable = True
    keys: ClassVar[Fields] = {KEY: {"type": "object", "additionalProperties": False, "properties": {
        "vector_field": {"type": "string"}, "fields": {"type": "array", "items": {"type": "string"}}}}}

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> MemoryIndexOutput:
        raw = r.section(section[key], f"output.{key}", {"vector_field": {}, "fields": {}})
        return MemoryIndexOutput(r.optional_string(raw.get("vector_field"), f"output.{key}.vector_field")
                                 or "embedding", tuple(r.string_list(raw.get("fields", []), f"output.{key}.fields")))


MEMORY = MemoryIndexFamily()
ENTRY = Plugin("memory", f"{__name__}:MEMORY")


def registered() -> None:
    """Adds the family to the TARGETS table (a test's fixture removes it with `removed`)."""
    register(TARGETS, ENTRY)


def removed() -> None:
    unregister(TARGETS, ENTRY.name)
    ROWS.clear()
    SEARCHES.clear()
