"""The nightly run: the same records again with a share changed, against a full run.

    python bench/incremental.py [--records 1000000] [--changed 0.05] [--workers 2]

Both runs go through `batchline run --publish` with the synthetic engine (no
time per record, so the figure is the pipeline's own cost); the second names
the first as its base and carries unchanged records by reference. Prints both
wall times, their ratio, and how many records reached the engine each time.
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


def write_input(path: Path, records: int, changed_every: int | None) -> None:
    with path.open("w") as f:
        for i in range(records):
            text = f"ticket {i}: printer on floor {i % 9} jams when printing from laptop {i % 13}"
            if changed_every and i % changed_every == 0:
                text += " (updated overnight)"
            f.write(json.dumps({"id": f"t-{i:08d}", "text": text, "acl": [f"team-{i % 5}"]}) + "\n")


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--changed", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds-per-record", type=float, default=0.0,
                        help="the synthetic engine's cost per record (0: the pipeline's own cost alone)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-incremental-"))
    store = f"sqlite:///{tmp / 'store.db'}"
    calls = tmp / "calls.log"
    write_input(tmp / "night1.jsonl", args.records, None)
    write_input(tmp / "night2.jsonl", args.records, round(1 / args.changed))
    write_spec(tmp / "night1.yaml", tmp / "night1.jsonl", calls, args.seconds_per_record)
    write_spec(tmp / "night2.yaml", tmp / "night2.jsonl", calls, args.seconds_per_record)
    full = run(tmp / "night1.yaml", store, args.workers)
    full_calls = lines(calls)
    calls.unlink()
    nightly = run(tmp / "night2.yaml", store, args.workers)
    nightly_calls = lines(calls)
    print(f"{args.records:,} records, {args.changed:.0%} changed, {args.workers} workers, synthetic engine "
          f"at {args.seconds_per_record * 1000:g} ms a record, SQLite")
    print(f"full run:        {full:8.1f} s  ({full_calls:,} records inferred)")
    print(f"incremental run: {nightly:8.1f} s  ({nightly_calls:,} records inferred, the rest carried)")
    print(f"ratio: {nightly / full:.3f} of the full run's wall time")
    print("command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
