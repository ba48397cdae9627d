"""Would it come out the same? A seeded sample of a sealed version recomputed and compared.

Keys guarantee one result per record, not one answer: the first attempt whose result was
stored is the version's answer (put-if-absent), and a later attempt's is never written.
Engines are not batch-invariant: at temperature 0 a record can decode differently in
another batch, on another device or another build. This check recomputes `sample` records
(chosen by a seeded hash of their ids, so the same seed chooses the same records) with the
version's pinned engine in a fresh engine process, in batches of another size than the
workers' (`validate.reproduce.batch_size`), and compares each with its stored result:

- exact agreement: the same validated output, byte for byte in its canonical JSON;
- label agreement, where the spec names `output.label_field`: the same label;
- for vectors (an output field that is a list of numbers, as an embedding's is): their
  cosine similarity with the stored ones, a record agreeing at `min_cosine` or more.

`min_agreement` gates the publish on the share that agrees (`on: output`, every field
equal, vectors within `min_cosine`; or `on: label`). The engine is reached through a port
(`Recompute`) that the worker layer provides: this module only chooses, reads and compares.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from batchline.check.report import Check
from batchline.digests import choose
from batchline.errors import BatchlineError
from batchline.snapshot import Record, records_of
from batchline.spec import JobSpec, ReproduceSpec
from batchline.store import Store, StoredResult

EXAMPLES_SHOWN = 5


@dataclass(frozen=True)
class Recomputed:
    """One record's fresh answer: its validated output (canonical JSON), or why there is none."""

    output: str | None
    error: str | None = None


class Recompute(Protocol):
    """Runs the version's pinned engine on `records` in a fresh engine process, `batch_size`
    records at a time, and validates each answer as a worker would; returns each record's
    answer and the engine runtime that computed them (None where the engine reports none)."""

    def __call__(self, spec: JobSpec, records: Sequence[Record],
                 batch_size: int) -> tuple[Mapping[str, Recomputed], str | None]: ...


def _records(store: Store, version: str, spec: JobSpec, results: Mapping[str, StoredResult]) -> list[Record]:
    found = records_of(store, version, spec, {rid: r.shard_no for rid, r in results.items()})
    return [found[rid] for rid in results if rid in found]


def _vectors(value: Any) -> dict[str, list[float]]:
    if not isinstance(value, dict):
        return {}
    return {k: [float(x) for x in v] for k, v in value.items()
            if isinstance(v, list) and v and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)}


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        return -1.0
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else (1.0 if na == nb else 0.0)


@dataclass
class _Tally:
    compared: int = 0
    exact: int = 0
    label_compared: int = 0
    label: int = 0
    agreed: int = 0
    failed: int = 0  # no valid answer this time
    cosines: list[float] | None = None


def check_reproducible(store: Store, version: str, spec: JobSpec, rep: ReproduceSpec,
                       recompute: Recompute | None) -> Any:
    """The `reproducibility` check of a sealed version (see the module's doc)."""
    if recompute is None:
        raise BatchlineError("validate.reproduce recomputes records with the version's engine: validate it through "
                             "batchline (`batchline validate`, Jobs.validate), which starts one")
    workers = spec.shards.batch_size
    batch = rep.check_batch_size(workers)
    answered = store.status(version).results
    ids = choose((r.record_id for r in store.iter_results(version)), rep.sample, rep.seed)
    stored = store.results_for(version, ids)
    records = _records(store, version, spec, stored)
    fresh, runtime = recompute(spec, records, batch) if records else ({}, None)
    pinned = store.pinned_runtime(version)
    tally = _Tally(cosines=[])
    assert tally.cosines is not None
    disagreements: list[str] = []
    label = spec.label_field
    for record in records:
        old, new = stored[record.id], fresh.get(record.id)
        tally.compared += 1
        if new is None or new.output is None:
            tally.failed += 1
            if len(disagreements) < EXAMPLES_SHOWN:
                disagreements.append(f"{record.id}: no answer this time "
                                     f"({new.error if new is not None else 'not returned'})")
            continue
        same = old.output == new.output
        tally.exact += same
        before, after = json.loads(old.output), json.loads(new.output)
        vectors_before, vectors_after = _vectors(before), _vectors(after)
        close = True
        for key, vector in vectors_before.items():
            c = cosine(vector, vectors_after.get(key, []))
            tally.cosines.append(c)
            close = close and c >= rep.min_cosine
        rest_same = ({k: v for k, v in before.items() if k not in vectors_before} ==
                     {k: v for k, v in after.items() if k not in vectors_after}) if isinstance(before, dict) and \
            isinstance(after, dict) else same
        label_same = None
        if label is not None and isinstance(before, dict) and isinstance(after, dict):
            tally.label_compared += 1
            label_same = before.get(label) == after.get(label)
            tally.label += label_same
        agrees = bool(label_same) if rep.on == "label" else (same or (bool(vectors_before) and close and rest_same))
        tally.agreed += agrees
        if not agrees and len(disagreements) < EXAMPLES_SHOWN:
            disagreements.append(f"{record.id}: stored {_short(old.output)}, now {_short(new.output)}")
    share = tally.agreed / tally.compared if tally.compared else 1.0
    exact = tally.exact / tally.compared if tally.compared else 1.0
    passed = rep.min_agreement is None or (tally.compared > 0 and share >= rep.min_agreement)
    scope = (f"all {tally.compared:,} results (validate.reproduce.sample {rep.sample:,} is more than the version "
             f"holds)" if rep.sample >= answered else f"{tally.compared:,} of {answered:,} results")
    parts = [f"exact {exact:.1%}"]
    if tally.label_compared:
        parts.append(f"{label} {tally.label / tally.label_compared:.1%}")
    if tally.cosines:
        parts.append(f"cosine mean {sum(tally.cosines) / len(tally.cosines):.6f}, min {min(tally.cosines):.6f}")
    gate = (f"agreement on {rep.on} {share:.1%} (limit {rep.min_agreement:.0%})" if rep.min_agreement is not None
            else f"agreement on {rep.on} {share:.1%} (reported, no limit)")
    built = "" if runtime is None or runtime == pinned else (
        f"; with the engine runtime {runtime}, not the workers' {pinned or 'unrecorded'}")
    figure = (f"{gate}; {', '.join(parts)}; {scope} chosen by seed {rep.seed}, recomputed in a fresh engine "
              f"process in batches of {batch} (the workers' {workers}){built}")
    details: dict[str, Any] = {
        "sample": tally.compared, "asked": rep.sample, "results": answered, "seed": rep.seed,
        "batch_size": batch, "workers_batch_size": workers, "on": rep.on, "agreement": share,
        "exact_agreement": exact, "min_agreement": rep.min_agreement, "failed": tally.failed,
        "label_agreement": tally.label / tally.label_compared if tally.label_compared else None,
        "cosine_mean": sum(tally.cosines) / len(tally.cosines) if tally.cosines else None,
        "cosine_min": min(tally.cosines) if tally.cosines else None, "min_cosine": rep.min_cosine,
        "disagreements": disagreements, "runtime": runtime, "workers_runtime": pinned,
    }
    return Check("reproducibility", passed, figure, details)


def _short(output: str, limit: int = 80) -> str:
    return output if len(output) <= limit else output[:limit - 3] + "..."
