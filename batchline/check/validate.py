"""The gate between a sealed version and its readers (I3).

Coverage, dead letters and drift run in the store (an anti-join and GROUP BY
over columns written with each result), so they stay fast at tens of
millions of rows; the schema re-check streams the stored results (or a sample
the spec asks for), and evaluation reads only its sample.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from batchline.check.outputs import OutputChecker
from batchline.check.report import Check, ValidationReport
from batchline.check.reproduce import Recompute, check_reproducible
from batchline.errors import BatchlineError
from batchline.spec import EvalSpec, JobSpec, JobVersion, stored_spec
from batchline.store import Store, require_job
from batchline.targets.files import SHARD_FILES_CHECK, check_shard_files

PSI_EPSILON = 1e-4  # stands in for a category's share where it is absent, so PSI stays finite


def validate(store: Store, version: str, *, record: bool = True, recompute: Recompute | None = None) -> ValidationReport:
    """The gate's checks of a sealed version, recorded in the store (`record`); `recompute`
    runs the version's engine for the reproducibility check (`validate.reproduce`), which the
    caller provides from the worker layer."""
    info = require_job(store, version)
    if info.state == "cancelled":
        raise BatchlineError(f"{version} was cancelled: a cancelled version is not validated")
    if info.state != "sealed":
        st = store.status(version)
        raise BatchlineError(f"{version} is not sealed ({st.pending:,} records without an outcome); "
                             "only a finished version is validated")
    spec = stored_spec(info)
    started = time.perf_counter()
    checks = [check_coverage(store, version), check_schema(store, version, spec),
              check_dead_letters(store, version, spec), check_drift(store, version, spec)]
    if any(t.shard_files() is not None for t in spec.targets):
        checks.append(check_worker_files(store, JobVersion(info, spec)))
    if spec.validate.eval is not None:
        checks.append(check_eval(store, version, spec, spec.validate.eval))
    if spec.validate.reproduce is not None:
        checks.append(check_reproducible(store, version, spec, spec.validate.reproduce, recompute))
    report = ValidationReport(version, all(c.passed for c in checks), checks, time.perf_counter() - started)
    if record:
        store.record_validation(version, report.passed, report.to_json())
    return report


def check_coverage(store: Store, version: str) -> Check:
    cov = store.coverage(version)
    passed = cov.missing == 0 and cov.unexpected == 0 and cov.both == 0
    figure = (f"{cov.records:,} snapshot ids; {cov.missing} without an outcome, "
              f"{cov.unexpected} outcomes not in the snapshot, {cov.both} with both")
    return Check("coverage", passed, figure, {
        "records": cov.records, "missing": cov.missing, "unexpected": cov.unexpected, "both": cov.both,
        "missing_sample": list(cov.missing_sample), "unexpected_sample": list(cov.unexpected_sample)})


def check_worker_files(store: Store, job: JobVersion) -> Check:
    """The files the workers wrote of their shards (`files: per-shard`), each compared with the
    store's rows before it may be published: at the path the store derives, its pin whole and
    equal, its rows every column equal (I8). Run here, not in publish, so a publish stays one
    catalog commit: publish only checks each file's pin against what this check recorded."""
    files: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    count = 0
    for t in job.spec.targets:
        if t.shard_files() is None:
            continue
        key = t.target(store.url, job.spec.input.storage).key
        checked, refused = check_shard_files(store, job, t, key, job.spec.input.storage)
        files[key] = {str(n): f.to_json() for n, f in sorted(checked.items())}
        problems.extend(refused)
        count += len(checked) + len(refused)
    figure = (f"{count:,} shard files, each the store's rows" if not problems
              else f"{len(problems)} of {count:,} shard files refused: {problems[0]}")
    return Check(SHARD_FILES_CHECK, not problems, figure, {"files": files, "refused": problems[:20]})


def _sampled(rows: Iterator[Any], total: int, sample: int | None) -> Iterator[Any]:
    if sample is None or sample >= total:
        yield from rows
        return
    step = total / sample
    next_index = 0.0
    for i, row in enumerate(rows):
        if i >= next_index:
            yield row
            next_index += step


def check_schema(store: Store, version: str, spec: JobSpec) -> Check:
    """Re-checks the results this version computed. A carried result was checked
    when its own version was validated, against the same schema: carrying is
    allowed only between versions with the same model, prompt and schema."""
    checker = OutputChecker(spec.output_schema)
    info = store.job(version)
    carried = info.carried if info else 0
    total = store.status(version).results - carried
    sample = spec.validate.schema_sample
    checked = invalid = 0
    examples: list[str] = []
    for record_id, output in _sampled(store.iter_outputs(version), total, sample):
        checked += 1
        problem = checker.problem(output)
        if problem is not None:
            invalid += 1
            if len(examples) < 5:
                examples.append(f"{record_id}: {problem}")
    sampled = sample is not None and sample < total
    scope = f"a sample of {checked:,} of {total:,}" if sampled else "every result computed in this version"
    if carried:
        scope += f"; {carried:,} carried results were checked in the version that computed them"
    return Check("schema", invalid == 0, f"{invalid} invalid of {checked:,} checked ({scope})",
                 {"checked": checked, "invalid": invalid, "examples": examples, "sampled": sampled,
                  "carried": carried})


def check_dead_letters(store: Store, version: str, spec: JobSpec) -> Check:
    st = store.status(version)
    rate = st.dead_letters / st.records if st.records else 0.0
    limit = spec.validate.max_dead_letter_rate
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(st.dead_letters_by_kind.items())) or "none"
    return Check("dead_letters", rate <= limit, f"{st.dead_letters:,} ({rate:.2%}, limit {limit:.2%}): {kinds}",
                 {"count": st.dead_letters, "rate": rate, "limit": limit, "by_kind": st.dead_letters_by_kind})


def population_stability(expected: dict[str, int], actual: dict[str, int]) -> float:
    """PSI = sum over categories of (a - e) * ln(a / e), on shares, absent shares smoothed."""
    e_total, a_total = sum(expected.values()) or 1, sum(actual.values()) or 1
    psi = 0.0
    for cat in set(expected) | set(actual):
        e = max(expected.get(cat, 0) / e_total, PSI_EPSILON)
        a = max(actual.get(cat, 0) / a_total, PSI_EPSILON)
        psi += (a - e) * math.log(a / e)
    return psi


def check_drift(store: Store, version: str, spec: JobSpec) -> Check:
    if spec.label_field is None:
        return Check("drift", True, "skipped: the spec names no output.label_field")
    published = store.resolve_name(spec.name)
    current = {str(k): v for k, v in store.label_counts(version).items() if k is not None}
    if published is None or published == version:
        what = "nothing published yet" if published is None else "this version is the published one"
        return Check("drift", True, f"skipped: {what}", {"distribution": current})
    before = {str(k): v for k, v in store.label_counts(published).items() if k is not None}
    psi = population_stability(before, current)
    new = sorted(set(current) - set(before))
    vanished = sorted(set(before) - set(current))
    d = spec.validate.drift
    passed = (psi <= d.max_psi and len(new) <= d.max_new_categories
              and (d.max_vanished_categories is None or len(vanished) <= d.max_vanished_categories))
    figure = (f"{spec.label_field}: PSI {psi:.3f} against {published} (limit {d.max_psi}); "
              f"new {new or 'none'}, vanished {vanished or 'none'}")
    return Check("drift", passed, figure, {"psi": psi, "against": published, "new": new, "vanished": vanished,
                                           "distribution": current, "published_distribution": before})


def _load_grader(path: str) -> Callable[[Any, str, str], Any]:
    module_name, _, func = path.partition(":")
    try:
        grader: Callable[[Any, str, str], Any] = getattr(importlib.import_module(module_name), func)
    except (ImportError, AttributeError) as exc:
        raise BatchlineError(f"validate.eval.grader {path!r} cannot be loaded: {exc}") from None
    return grader


def _labels(ev: EvalSpec) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with ev.labels.open(encoding="utf-8", newline="") as f:
            if ev.labels.suffix.lower() == ".csv":
                for row in csv.DictReader(f):
                    out[str(row[ev.id_field])] = str(row[ev.label_field])
            else:
                for line in f:
                    if line.strip():
                        obj = json.loads(line)
                        if ev.label_field in obj:
                            out[str(obj[ev.id_field])] = str(obj[ev.label_field])
    except (OSError, KeyError, ValueError) as exc:
        raise BatchlineError(f"validate.eval.labels {ev.labels}: cannot read labels: {exc}") from None
    return out


def check_eval(store: Store, version: str, spec: JobSpec, ev: EvalSpec) -> Check:
    labels = _labels(ev)
    # A deterministic sample spread over the id space rather than the first rows;
    # labelled records without a result (dead letters, other snapshots) are skipped.
    ordered = sorted(labels, key=lambda i: hashlib.sha256(i.encode()).digest())
    results: dict[str, Any] = {}
    for start in range(0, len(ordered), 2 * ev.sample):
        results.update(store.results_for(version, ordered[start:start + 2 * ev.sample]))
        if len(results) >= ev.sample:
            break
    ids = [i for i in ordered if i in results][:ev.sample]
    grader = _load_grader(ev.grader) if ev.grader else None
    score = 0.0
    # Expected label -> answered label -> records: where the misses go, not only how many.
    confusion: dict[str, dict[str, int]] = {}
    for rid in ids:
        value = json.loads(results[rid].output)
        got = value.get(ev.field) if isinstance(value, dict) else None
        if grader is not None:
            score += float(grader(value, labels[rid], rid))
        else:
            score += float(str(got) == labels[rid])
        row = confusion.setdefault(labels[rid], {})
        row[str(got)] = row.get(str(got), 0) + 1
    accuracy = score / len(ids) if ids else 0.0
    passed = bool(ids) and accuracy >= ev.min_accuracy
    how = f"grader {ev.grader}" if ev.grader else f"{ev.field} == {ev.label_field}"
    return Check("evaluation", passed, f"accuracy {accuracy:.1%} on {len(ids)} labelled records "
                 f"({how}; limit {ev.min_accuracy:.0%})",
                 {"accuracy": accuracy, "sample": len(ids), "labelled": len(labels), "min_accuracy": ev.min_accuracy,
                  "field": ev.field, "confusion": confusion})
