"""The graders on the ticket example's real outputs: what they catch, what they fail on their own,
and what they cost.

    make demo                                     # Gemma 3 270M over 299 tickets, into demo/
    python bench/graders.py [--store sqlite:///demo/batchline.db] [--skip-judge] [--skip-injection]

Each figure is measured on a copy of the demo's store (the demo's own is never written), the
version validated by examples/tickets/checked.yaml's gate (the same job as job.yaml, so the
same version):

1. faithful (summary, k = 20, every result): on the version as the model wrote it, then on
   copies with 10% of the summaries (chosen by seed, `--seeds` copies) each replaced by its
   neighbour's (the next ticket by id): the share of shifted rows it fails, the share of
   untouched rows it fails, and (first seed) ten of those untouched failures with their tickets,
   to read, and the shifted rows it let through;
2. grounded (entities, every result): on a copy with 10% of the rows' entities replaced by
   words that are not in their ticket: the share of replaced rows it fails, and the share of
   untouched rows it fails (the model's own entities that are not in the ticket);
3. judge: Gemma 3 270M judging 100 results (checked.yaml's judge), run as its own job by one
   local worker: its pass share and seconds per record;
4. injection: 50 canaries (examples/tickets/injections.jsonl) through the demo's model and
   prompt, then through the hardened prompt (triage-hardened.prompt: the same, with an
   instruction after the fenced record), on the same canaries: the share obeyed.

Times are wall-clock on this machine (2 cores, the model on the CPU), one run each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchline.api import Jobs  # noqa: E402
from batchline.check.graders.base import Grading, with_records  # noqa: E402
from batchline.digests import choose  # noqa: E402
from batchline.registry import GRADERS, keyed  # noqa: E402
from batchline.spec import stored_spec  # noqa: E402
from batchline.store import Store, open_store  # noqa: E402
from batchline.worker.recompute import recompute  # noqa: E402

EXAMPLE = ROOT / "examples" / "tickets"
SHARE = 0.10
SEED = 11
# Words no IT ticket of the sample holds, each checked against its ticket before it is planted.
FOREIGN = ["kubernetes", "blockchain", "hovercraft", "saxophone", "volcano", "origami"]


def copy_store(source: str, folder: Path, name: str) -> str:
    path = Path(source.removeprefix("sqlite:///"))
    if not path.exists():
        raise SystemExit(f"{path} does not exist: run `make demo` first")
    target = folder / f"{name}.db"
    shutil.copy(path, target)
    return f"sqlite:///{target}"


def gated(url: str) -> tuple[Store, str]:
    """The store at `url` with the demo's version validated by checked.yaml's gate."""
    store = open_store(url)
    planned = Jobs(store).plan(EXAMPLE / "checked.yaml", log=lambda _m: None)
    info = store.job(planned.version)
    if info is None or info.state != "sealed":
        raise SystemExit(f"{planned.version} is not sealed in the demo's store: run `make demo` first")
    return store, planned.version


def grade(store: Store, version: str, key: str, verdicts: dict[str, bool],
          recompute_with: Callable[..., Any] | None = None, **changes: Any) -> dict[str, Any]:
    spec = stored_spec(store.job(version))  # type: ignore[arg-type]
    section = spec.validate.grader(key)
    assert section is not None, key
    if changes:
        section = replace(section, **changes)  # type: ignore[type-var]
    grading = Grading(store, version, spec, recompute=recompute_with, verdicts=verdicts)
    started = time.perf_counter()
    check = keyed(GRADERS)[key].grade(grading, section)
    out = dict(check.details)
    out.update(figure=check.figure, passed=check.passed, wall=time.perf_counter() - started)
    return out


def set_outputs(store: Store, version: str, outputs: dict[str, dict[str, Any]]) -> None:
    """A copy of the version whose stored outputs differ: what a broken version would hold."""
    import sqlite3

    conn = sqlite3.connect(store.url.removeprefix("sqlite:///"), isolation_level=None)
    for rid, output in outputs.items():
        conn.execute("UPDATE results SET output = ? WHERE version = ? AND record_id = ?",
                     (json.dumps(output), version, rid))
    conn.close()


def answers(store: Store, version: str) -> dict[str, dict[str, Any]]:
    return {rid: json.loads(out) for rid, out in store.iter_outputs(version)}


def texts(store: Store, version: str) -> dict[str, str]:
    """Each result's ticket, read again from the input as the graders read it."""
    grading = Grading(store, version, stored_spec(store.job(version)))  # type: ignore[arg-type]
    results = store.results_for(version, list(answers(store, version)))
    return {result.record_id: record.text for result, record in with_records(grading, results)}


def faithful(url: str, folder: Path, seeds: int) -> None:
    store, version = gated(copy_store(url, folder, "faithful-clean"))
    clean: dict[str, bool] = {}
    before = grade(store, version, "faithful", clean)
    own_failures = sorted(rid for rid, ok in clean.items() if not ok)
    print(f"faithful, the version as written: {before['figure']}")
    caught_all = shifted_all = untouched_failed_all = untouched_all = 0
    for n in range(seeds):
        seed = SEED + n
        store, version = gated(copy_store(url, folder, f"faithful-shifted-{seed}"))
        given = answers(store, version)
        ids = sorted(given)
        shifted = sorted(choose(ids, round(len(ids) * SHARE), seed))
        set_outputs(store, version, {rid: {**given[rid], "summary": given[ids[(ids.index(rid) + 1) % len(ids)]]
                                           ["summary"]} for rid in shifted})
        verdicts: dict[str, bool] = {}
        after = grade(store, version, "faithful", verdicts)
        caught = [rid for rid in shifted if verdicts.get(rid) is False]
        untouched = [rid for rid in ids if rid not in shifted]
        untouched_failed = [rid for rid in untouched if verdicts.get(rid) is False]
        caught_all += len(caught)
        shifted_all += len(shifted)
        untouched_failed_all += len(untouched_failed)
        untouched_all += len(untouched)
        print(f"faithful, {len(shifted)} of {len(ids)} summaries (seed {seed}) shifted to a neighbour's: "
              f"{after['figure']}")
        print(f"  shifted rows failed: {len(caught)}/{len(shifted)} ({len(caught) / len(shifted):.0%}); untouched "
              f"rows failed: {len(untouched_failed)}/{len(untouched)} ({len(untouched_failed) / len(untouched):.1%})")
        if n == 0:
            print(f"  the version as written fails {len(own_failures)}/{len(ids)}")
            ticket = texts(store, version)
            print("  ten untouched failures (ticket | summary), to read:")
            for rid in untouched_failed[:10]:
                print(f"    {rid}: {ticket[rid][:110]!r}\n      -> {given[rid]['summary']!r}")
            passed = [rid for rid in shifted if verdicts.get(rid) is True]
            print("  shifted rows that passed (their ticket | the neighbour's summary):")
            for rid in passed:
                print(f"    {rid}: {ticket[rid][:90]!r}\n      -> {given[ids[(ids.index(rid) + 1) % len(ids)]]['summary']!r}")
    print(f"faithful over {seeds} seeds: shifted rows failed {caught_all}/{shifted_all} ({caught_all / shifted_all:.0%}; "
          f"goal >= 90%), untouched rows failed {untouched_failed_all}/{untouched_all} "
          f"({untouched_failed_all / untouched_all:.1%})")


def grounded(url: str, folder: Path) -> None:
    store, version = gated(copy_store(url, folder, "grounded"))
    given = answers(store, version)
    ticket = texts(store, version)
    ids = sorted(given)
    replaced = sorted(choose(ids, round(len(ids) * SHARE), SEED + 1))
    planted = {}
    for n, rid in enumerate(replaced):
        words = [w for w in FOREIGN if w not in ticket[rid].casefold()]
        planted[rid] = {**given[rid], "entities": [words[n % len(words)]]}
    set_outputs(store, version, planted)
    verdicts: dict[str, bool] = {}
    after = grade(store, version, "grounded", verdicts)
    caught = [rid for rid in replaced if verdicts.get(rid) is False]
    untouched = [rid for rid in ids if rid not in replaced]
    untouched_failed = [rid for rid in untouched if verdicts.get(rid) is False]
    print(f"grounded, {len(replaced)} of {len(ids)} rows' entities replaced by words not in the ticket: "
          f"{after['figure']}")
    print(f"  replaced rows failed: {len(caught)}/{len(replaced)}; goal: all")
    print(f"  untouched rows failed (the model's own entities not in the ticket): {len(untouched_failed)}/"
          f"{len(untouched)} ({len(untouched_failed) / len(untouched):.1%})")
    for rid in untouched_failed[:5]:
        print(f"    {rid}: entities {given[rid]['entities']!r}")


def judge(url: str, folder: Path) -> None:
    store, version = gated(copy_store(url, folder, "judge"))
    # This copy's gate is the judge alone, so the time is the judge's.
    gate = stored_spec(store.job(version)).to_dict()["validate"]  # type: ignore[arg-type]
    store.set_gate(version, {k: v for k, v in gate.items() if k not in ("eval", "grounded", "faithful", "injection")},
                   "bench")
    started = time.perf_counter()
    report = Jobs(store).validate(version, log=lambda _m: None)
    wall = time.perf_counter() - started
    [check] = [c for c in report.checks if c.name == "judge"]
    judged = check.details["graded"]
    print(f"judge (Gemma 3 270M, 100 results, one local worker): {check.figure}")
    print(f"  validate with the judge: {wall:.0f} s, {wall / max(judged, 1):.2f} s per judged record "
          f"(the judge's planning and model load included)")
    # Whether it tells right from wrong: the same judge on a copy whose every summary is its
    # neighbour's (a new judge version: its records hold the shifted outputs).
    store, version = gated(copy_store(url, folder, "judge-shifted"))
    store.set_gate(version, {k: v for k, v in gate.items() if k not in ("eval", "grounded", "faithful", "injection")},
                   "bench")
    given = answers(store, version)
    ids = sorted(given)
    set_outputs(store, version, {rid: {**given[rid], "summary": given[ids[(n + 1) % len(ids)]]["summary"]}
                                 for n, rid in enumerate(ids)})
    [shifted] = [c for c in Jobs(store).validate(version, log=lambda _m: None).checks if c.name == "judge"]
    print(f"  the same judge, every summary shifted to a neighbour's: {shifted.figure}")


def injection(url: str, folder: Path) -> None:
    store, version = gated(copy_store(url, folder, "injection"))
    plain: dict[str, bool] = {}
    first = grade(store, version, "injection", plain, recompute_with=recompute)
    print(f"injection, the demo's prompt: {first['figure']}")
    print(f"  by instruction: {json.dumps(first['by_instruction'])}")
    hardened_text = (EXAMPLE / "triage-hardened.prompt").read_text()
    spec = stored_spec(store.job(version))  # type: ignore[arg-type]
    hardened = replace(spec, prompt=replace(spec.prompt, text=hardened_text, version="v1-hardened"))
    section = spec.validate.grader("injection")
    hard: dict[str, bool] = {}
    grading = Grading(store, version, hardened, recompute=recompute, verdicts=hard)
    check = keyed(GRADERS)["injection"].grade(grading, section)
    print(f"injection, the hardened prompt (the same canaries): {check.figure}")
    print(f"  by instruction: {json.dumps(check.details['by_instruction'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default=f"sqlite:///{ROOT / 'demo' / 'batchline.db'}")
    parser.add_argument("--seeds", type=int, default=5, help="copies with shifted summaries, each another seed")
    parser.add_argument("--skip-judge", action="store_true")
    parser.add_argument("--skip-injection", action="store_true")
    args = parser.parse_args()
    print(f"graders on {args.store}, {time.strftime('%Y-%m-%d')}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        faithful(args.store, folder, args.seeds)
        grounded(args.store, folder)
        if not args.skip_injection:
            injection(args.store, folder)
        if not args.skip_judge:
            judge(args.store, folder)


if __name__ == "__main__":
    main()
