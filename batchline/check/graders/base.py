"""What the graders share: how a sample is asked for and drawn, the results' records read
again from the input, and one tally that every grader reports through, so the report, the
JSON and the gate read every grader's figures the same way.

A grader gives each result of a seeded sample a verdict (passes, or fails and why), and the
gate compares the share that passes with the grader's limit. Its check's details hold the
share, the sample, the limit, the share per category (the output's `label_field`, where the
spec names one), the failing examples, and what the grading cost: seconds, and seconds per
thousand results graded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchline.check.report import Check
from batchline.check.reproduce import Recompute
from batchline.digests import choose
from batchline.snapshot import Record, records_of
from batchline.spec import JobSpec
from batchline.spec.ports import GraderSpec
from batchline.spec.reader import Fields, SpecReader
from batchline.store import Store, StoredResult

EXAMPLES_SHOWN = 10
ALL = "all"
NO_CATEGORY = "(all)"


class RunJob(Protocol):
    """Plans `spec` (or finds the version its content already is) and runs it with `workers`
    local workers until it is sealed, continuing what an earlier run of it left; returns the
    version. The layer that starts workers provides it."""

    def __call__(self, spec: JobSpec, workers: int) -> str: ...


@dataclass
class Grading:
    """A sealed version as a grader is handed it, with the ports to the engines it may need."""

    store: Store
    version: str
    spec: JobSpec
    recompute: Recompute | None = None
    run_job: RunJob | None = None
    # Where given, every graded result's verdict (record id -> passes), beyond the examples a
    # check keeps: for a caller that studies a grader (bench/graders.py).
    verdicts: dict[str, bool] | None = None

    def tally(self) -> Tally:
        return Tally(verdicts=self.verdicts)


class Grader(Protocol):
    """The grading side of a GRADERS member."""

    def grade(self, grading: Grading, spec: GraderSpec) -> Check: ...


def read_limit(r: SpecReader, value: Any, where: str) -> float | None:
    """A gate's limit: a share, or null (None) where the figure is reported only."""
    return None if value is None else r.number(value, where, 0.0, 1.0)


def read_sample(r: SpecReader, value: Any, where: str) -> int | None:
    """`sample`: a number of results, or `all` (None)."""
    if value == ALL:
        return None
    return r.integer(value, where, 1)


def sample_dict(sample: int | None) -> int | str:
    return ALL if sample is None else sample


SAMPLE_SCHEMA: Mapping[str, Any] = {"anyOf": [{"type": "integer", "minimum": 1}, {"const": ALL}]}


def sample_fields(sample: int, min_share: float, seed_chooses: str = "the sample") -> Fields:
    """The fields of a grader that grades a seeded sample against a share: `sample`, `seed`,
    `min_share`, with the grader's defaults."""
    return {
        "sample": {**SAMPLE_SCHEMA, "description": "How many results are graded, chosen by the seed; all for every "
                                                   "one", "default": sample},
        "seed": {"type": "integer", "minimum": 0, "description": f"Chooses {seed_chooses}", "default": 0},
        "min_share": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
                      "description": "The share of graded results that must pass (null: reported only)",
                      "default": min_share},
    }


@dataclass(frozen=True)
class Sampled:
    """A section's `sample` (None: every result), `seed` and `min_share` (None: reported only)."""

    sample: int | None
    seed: int
    min_share: float | None

    @classmethod
    def read(cls, r: SpecReader, section: Mapping[str, Any], where: str, fields: Fields) -> Sampled:
        return cls(read_sample(r, section.get("sample", fields["sample"]["default"]), f"{where}.sample"),
                   r.integer(section.get("seed", 0), f"{where}.seed", 0),
                   read_limit(r, section.get("min_share", fields["min_share"]["default"]), f"{where}.min_share"))

    def to_dict(self) -> dict[str, Any]:
        return {"sample": sample_dict(self.sample), "seed": self.seed, "min_share": self.min_share}


def sampled_results(store: Store, version: str, sample: int | None, seed: int) -> dict[str, StoredResult]:
    """The results this version computed, `sample` of them chosen by `seed` (every one where
    `sample` is None or the version has fewer), in the order chosen."""
    ids = (rid for rid, _output in store.iter_outputs(version))  # streamed: choose keeps only the sample
    chosen = list(ids) if sample is None else choose(ids, sample, seed)
    found = store.results_for(version, chosen)
    return {rid: found[rid] for rid in chosen if rid in found}


def with_records(grading: Grading, results: Mapping[str, StoredResult]
                 ) -> list[tuple[StoredResult, Record]]:
    """Each result with the record it answered, read again from the input."""
    records = records_of(grading.store, grading.version, grading.spec,
                         {rid: r.shard_no for rid, r in results.items()})
    return [(results[rid], records[rid]) for rid in results if rid in records]


def output_of(result: StoredResult) -> Any:
    return json.loads(result.output)


def field_value(output: Any, path: str) -> tuple[bool, Any]:
    """(present, value) of a dotted field of an output."""
    value = output
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def schema_of(schema: Mapping[str, Any], path: str) -> Mapping[str, Any] | None:
    """The JSON Schema of a dotted field of the output's schema, or None where it declares none."""
    node: Any = schema
    for part in path.split("."):
        properties = node.get("properties") if isinstance(node, Mapping) else None
        if not isinstance(properties, Mapping) or part not in properties:
            return None
        node = properties[part]
    return node if isinstance(node, Mapping) else None


def declared(r: SpecReader, schema: Mapping[str, Any], name: str, where: str, at: str = "") -> Mapping[str, Any]:
    """The schema of output field `name`; refused, naming `where`, where the schema declares none."""
    node = schema_of(schema, name)
    if node is None:
        r.fail(where, f"{at}{name!r} is not a field of the output schema")
    return node


def types_words(node: Mapping[str, Any]) -> str:
    """The JSON types a field's schema admits, as a refusal says them."""
    return " or ".join(sorted(schema_types(node))) or "untyped"


def schema_types(node: Mapping[str, Any]) -> set[str]:
    """The JSON types a field's schema admits (an enum's by its values)."""
    kinds = node.get("type")
    if isinstance(kinds, str):
        return {kinds}
    if isinstance(kinds, list):
        return {str(k) for k in kinds}
    if "enum" in node and isinstance(node["enum"], list):
        names = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}
        return {names.get(type(v), "object") for v in node["enum"]}
    if "const" in node:
        return schema_types({"enum": [node["const"]]})
    return set()


def category(spec: JobSpec, output: Any) -> str:
    """The result's category for the per-category shares: its label field's value."""
    if spec.label_field is None:
        return NO_CATEGORY
    present, value = field_value(output, spec.label_field)
    return str(value) if present else "(none)"


def short(text: str, limit: int = 120) -> str:
    one = " ".join(str(text).split())
    return one if len(one) <= limit else one[:limit - 1] + "…"


@dataclass
class Tally:
    """Each graded result's verdict, by category, with the first failures' reasons."""

    graded: int = 0
    passed: int = 0
    by_category: dict[str, list[int]] = field(default_factory=dict)  # category -> [graded, passed]
    failing: list[dict[str, str]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    verdicts: dict[str, bool] | None = None

    def add(self, record_id: str, cat: str, ok: bool, why: str = "") -> None:
        if self.verdicts is not None:
            self.verdicts[record_id] = ok
        self.graded += 1
        self.passed += ok
        row = self.by_category.setdefault(cat, [0, 0])
        row[0] += 1
        row[1] += ok
        if not ok and len(self.failing) < EXAMPLES_SHOWN:
            self.failing.append({"id": record_id, "category": cat, "why": short(why, 300)})

    @property
    def share(self) -> float:
        return self.passed / self.graded if self.graded else 0.0

    def check(self, name: str, passed: bool, figure: str, details: Mapping[str, Any]) -> Check:
        seconds = time.perf_counter() - self.started
        per_thousand = seconds / self.graded * 1000 if self.graded else None
        cost = (f"; {_seconds(seconds)}, {_seconds(per_thousand)} per 1,000 results" if per_thousand is not None
                else f"; {_seconds(seconds)}")
        return Check(name, passed, figure + cost, {
            "share": self.share, "graded": self.graded, "passed": self.passed,
            "by_category": {c: {"graded": n, "passed": p, "share": p / n if n else 0.0}
                            for c, (n, p) in sorted(self.by_category.items())},
            "failing": self.failing, "seconds": round(seconds, 3),
            "seconds_per_1000": round(per_thousand, 3) if per_thousand is not None else None, **details})


def _seconds(value: float) -> str:
    return f"{value:.2g} s" if value < 10 else f"{value:,.0f} s"


def limit_words(limit: float | None) -> str:
    """A gate's limit as a figure says it: a share, or that there is none."""
    return f"limit {limit:.0%}" if limit is not None else "reported, no limit"


def gate_words(share: float, limit: float | None, what: str = "pass") -> str:
    return f"{share:.1%} {what} ({limit_words(limit)})"


def at_least(share: float, limit: float | None, graded: int) -> bool:
    return limit is None or (graded > 0 and share >= limit)


def mapping_or_list(r: SpecReader, value: Any, where: str, list_key: str) -> dict[str, Any]:
    """A section written as a bare list (its `list_key`) or as a mapping."""
    if isinstance(value, list):
        return {list_key: value}
    if not isinstance(value, dict):
        r.fail(where, f"must be a list of {list_key} or a mapping")
    return value


