"""The nightly run: the same records again with a share changed, against a full run.

    python bench/incremental.py [--records 1000000] [--changed 0.05] [--change text|acl] [--workers 2]
                                [--rounds 1]

Every run goes through `batchline run --publish` with the synthetic engine (no
time per record, so the figure is the pipeline's own cost); the second names
the first as its base and carries unchanged records by reference. `--change text`
changes the share's text (they are inferred again); `--change acl` changes only
their ACL (they are carried under the new ACL, no engine call). A third run over
the second's input, nothing changed, is the floor the second is measured against.
Prints each run's wall time (the minimum and median over --rounds, each round in
a new store), how many records reached the engine, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

SCHEMA = Path(__file__).resolve().parents[1] / "examples" / "tickets" / "triage.schema.json"


def write_input(path: Path, records: int, changed_every: int | None, change: str = "text") -> None:
    with path.open("w") as f:
        for i in range(records):
            text = f"ticket {i}: printer on floor {i % 9} jams when printing from laptop {i % 13}"
            acl = [f"team-{i % 5}"]
            if changed_every and i % changed_every == 0:
                if change == "acl":
                    acl = ["legal", *acl]
                else:
                    text += " (updated overnight)"
            f.write(json.dumps({"id": f"t-{i:08d}", "text": text, "acl": acl}) + "\n")


def write_spec(path: Path, input_path: Path, calls: Path, seconds_per_record: float) -> None:
    path.write_text(yaml.safe_dump({
        "name": "nightly", "base": "published",
        "input": {"path": str(input_path), "acl_field": "acl"},
        "model": {"engine": "synthetic", "options": {"call_log": str(calls),
                                                     "seconds_per_record": seconds_per_record}},
        "prompt": {"text": "Classify the ticket.", "version": "v1"},
        "output": {"schema": str(SCHEMA), "label_field": "category"},
        "shards": {"size": 5000},
        "validate": {"drift": {"max_psi": 10, "max_new_categories": 10}},
    }))


def run(spec: Path, store: str, workers: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store, "--workers",
                    str(workers), "--publish"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def lines(path: Path) -> int:
    return sum(1 for _ in path.open()) if path.exists() else 0


def main() -> int:
    import statistics

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--changed", type=float, default=0.05)
    parser.add_argument("--change", choices=("text", "acl"), default="text",
                        help="what changes in the share: the text (inferred again) or only the ACL (carried)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="rounds, each in a new store (min and median shown)")
    parser.add_argument("--seconds-per-record", type=float, default=0.0,
                        help="the synthetic engine's cost per record (0: the pipeline's own cost alone)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-incremental-"))
    calls = tmp / "calls.log"
    write_input(tmp / "night1.jsonl", args.records, None)
    write_input(tmp / "night2.jsonl", args.records, round(1 / args.changed), args.change)
    write_spec(tmp / "night1.yaml", tmp / "night1.jsonl", calls, args.seconds_per_record)
    write_spec(tmp / "night2.yaml", tmp / "night2.jsonl", calls, args.seconds_per_record)
    # The third night reads the second's records again: nothing changed. A copy under another
    # name: the same file would be the same snapshot, found planned already.
    (tmp / "night3.jsonl").write_bytes((tmp / "night2.jsonl").read_bytes())
    write_spec(tmp / "night3.yaml", tmp / "night3.jsonl", calls, args.seconds_per_record)
    times: dict[str, list[float]] = {"full": [], "changed": [], "unchanged": []}
    inferred: dict[str, int] = {}
    for round_no in range(args.rounds):
        store = f"sqlite:///{tmp / f'store-{round_no}.db'}"
        for night, label in (("night1", "full"), ("night2", "changed"), ("night3", "unchanged")):
            calls.unlink(missing_ok=True)
            times[label].append(run(tmp / f"{night}.yaml", store, args.workers))
            inferred[label] = lines(calls)
    print(f"{args.records:,} records, {args.changed:.0%} changed ({args.change}), {args.workers} workers, "
          f"synthetic engine at {args.seconds_per_record * 1000:g} ms a record, SQLite, {args.rounds} rounds")
    names = {"full": "full run", "changed": f"{args.change} changed", "unchanged": "nothing changed"}
    for label, values in times.items():
        print(f"{names[label]:<16} min {min(values):8.1f} s  median {statistics.median(values):8.1f} s  "
              f"({inferred[label]:,} records inferred)")
    changed, floor, full = (statistics.median(times[k]) for k in ("changed", "unchanged", "full"))
    print(f"ratio: {changed / floor:.3f} of the nothing-changed run's wall time, {changed / full:.3f} of the full run's")
    print("command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
