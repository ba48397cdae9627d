"""Shard files written by the workers (`files: per-shard`) against the publisher writing every
file: the job's wall time with each, and the publish of the sealed version.

    python bench/shard_files.py [--records 1000000] [--workers 2] [--rounds 2]

The same job (the synthetic engine at no cost per record, shards of 5,000, a SQLite store and
catalog, the warehouse on local disk) run by `batchline run`, once with the publisher writing
the table's files and once with each worker writing its shard's file as it completes it,
alternating, each round over a new input of the same size (a new version). The run is timed
from the command's start to its exit; the publish (validation first, then the branch and the
commit that makes it main, through the publish path the command line uses) alone, and the
validation before it (with the workers' files it checks each file against the store's rows).
Prints each round and the medians, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = ROOT / "examples" / "tickets" / "triage.schema.json"
# Validate and publish of a million records with the workers' files, as BENCHMARKS.md recorded them
# before each file was checked against the store's rows: the check's goal is at most twice their sum.
REFERENCE_VALIDATE, REFERENCE_PUBLISH = 4.0, 0.71


def write_input(path: Path, records: int, round_no: int) -> None:
    with path.open("w") as f:
        for i in range(records):
            f.write(json.dumps({"id": f"t-{i:08d}", "text": f"round {round_no}: ticket {i} on floor {i % 9}",
                                "acl": [f"team-{i % 5}"]}) + "\n")


def write_spec(path: Path, data: Path, folder: Path, name: str, per_shard: bool) -> None:
    table = {"catalog": "store", "name": f"bench.{name}", "warehouse": str(folder / "warehouse")}
    if per_shard:
        table["files"] = "per-shard"
    path.write_text(yaml.safe_dump({
        "name": name, "input": {"path": str(data), "acl_field": "acl"},
        "model": {"engine": "synthetic"}, "prompt": {"text": "Classify the ticket.", "version": "v1"},
        "output": {"schema": str(SCHEMA), "table": table}, "shards": {"size": 5000}}))


def run_and_publish(spec: Path, store_url: str, workers: int) -> tuple[float, float, float]:
    from batchline.check.validate import validate
    from batchline.publish.pointer import publish
    from batchline.store import open_store

    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store_url, "--workers",
                           str(workers)], check=True, capture_output=True, text=True, cwd=ROOT)
    ran = time.perf_counter() - start
    version = done.stdout.strip().splitlines()[-1]
    store = open_store(store_url, create=False)
    try:
        start = time.perf_counter()
        assert validate(store, version).passed
        validated = time.perf_counter() - start
        start = time.perf_counter()
        publish(store, version)
        return ran, validated, time.perf_counter() - start
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-shard-files-"))
    store = f"sqlite:///{folder / 'store.db'}"
    figures: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for r in range(args.rounds):
        data = folder / f"records-{r}.jsonl"
        write_input(data, args.records, r)
        for per_shard in (False, True):
            name = f"{'workers' if per_shard else 'publisher'}-{r}"
            spec = folder / f"{name}.yaml"
            write_spec(spec, data, folder, name.split("-")[0], per_shard)
            ran, validated, published = run_and_publish(spec, store, args.workers)
            figures[per_shard].append((ran, validated, published))
            print(f"round {r + 1}, {'workers write the files' if per_shard else 'the publisher writes the files'}: "
                  f"run {ran:.1f} s, validate {validated:.2f} s, publish {published:.2f} s", flush=True)
    run_without = statistics.median(x[0] for x in figures[False])
    run_with = statistics.median(x[0] for x in figures[True])
    val_without = statistics.median(x[1] for x in figures[False])
    val_with = statistics.median(x[1] for x in figures[True])
    pub_without = statistics.median(x[2] for x in figures[False])
    pub_with = statistics.median(x[2] for x in figures[True])
    print(f"\n{args.records:,} records, {args.workers} workers, medians of {args.rounds} rounds")
    print(f"run:     publisher writes {run_without:.1f} s, workers write {run_with:.1f} s, "
          f"ratio {run_with / run_without:.3f}")
    print(f"validate: publisher writes {val_without:.2f} s (no file to check), workers wrote {val_with:.2f} s "
          f"(each shard file checked against the store's rows: {val_with - val_without:.2f} s)")
    print(f"publish: publisher writes {pub_without:.2f} s, workers wrote {pub_with:.2f} s")
    print(f"validate + publish with the workers' files: {val_with + pub_with:.2f} s "
          f"({(val_with + pub_with) / (REFERENCE_VALIDATE + REFERENCE_PUBLISH):.2f} x the {REFERENCE_VALIDATE} s + "
          f"{REFERENCE_PUBLISH} s recorded before files were checked)")
    per_round = [w[0] / p[0] for w, p in zip(figures[True], figures[False], strict=True)]
    print(f"run ratio per round: {', '.join(f'{x:.3f}' for x in per_round)}")
    print(f"command: python bench/shard_files.py --records {args.records} --workers {args.workers} "
          f"--rounds {args.rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
