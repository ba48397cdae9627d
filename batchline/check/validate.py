"""The gate between a sealed version and its readers (I3).

Coverage, dead letters and drift run in the store (an anti-join and GROUP BY
over columns written with each result), so they stay fast at tens of
millions of rows; the schema re-check streams the stored results (or a sample
the spec asks for), and the graders (`batchline.check.graders`) read only their samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

from batchline.check.graders.base import Grader, Grading, RunJob
from batchline.check.outputs import OutputChecker
from batchline.check.report import Check, ValidationReport
from batchline.check.reproduce import Recompute, check_reproducible
from batchline.errors import BatchlineError
from batchline.registry import GRADERS, keyed
from batchline.spec import JobSpec, JobVersion, stored_spec
from batchline.store import Store, require_job
from batchline.targets.files import SHARD_FILES_CHECK, check_shard_files

PSI_EPSILON = 1e-4  # stands in for a category's share where it is absent, so PSI stays finite


def validate(store: Store, version: str, *, record: bool = True, recompute: Recompute | None = None,
             run_job: RunJob | None = None) -> ValidationReport:
    """The gate's checks of a sealed version, recorded in the store (`record`); `recompute`
    runs the version's engine in a fresh process (`validate.reproduce`, the injection
    canaries) and `run_job` runs a job to its seal with local workers (a judge), both
    provided by the caller from the layers that start engines and workers."""
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
    if spec.validate.reproduce is not None:
        checks.append(check_reproducible(store, version, spec, spec.validate.reproduce, recompute))
    grading = Grading(store, version, spec, recompute, run_job)
    members: dict[str, Grader] = keyed(GRADERS)
    for grader_spec in spec.validate.graders:
        checks.append(members[grader_spec.key].grade(grading, grader_spec))
    report = ValidationReport(version, all(c.passed for c in checks), checks, time.perf_counter() - started)
    if record:
        store.record_validation(version, report.passed, report.to_json())
    return report


def check_names(spec: JobSpec) -> list[str]:
    """The checks `validate` reports for a version of `spec`, in its report's order: what an
    orchestrator declares before the version exists (a Dagster asset's checks)."""
    members = keyed(GRADERS)
    return ["coverage", "schema", "dead_letters", "drift",
            *([SHARD_FILES_CHECK] if any(t.shard_files() is not None for t in spec.targets) else []),
            *(["reproducibility"] if spec.validate.reproduce is not None else []),
            *(members[g.key].check for g in spec.validate.graders)]


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
