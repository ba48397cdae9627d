"""What a nightly publish into an Iceberg table costs: a full version published, then an
incremental version (`base` the full one) with a share of its records changed, published the same
way: the bytes each writes and the time each takes.

    python bench/nightly_publish.py [--records 1000000] [--changed 0.05] [--where recent|random|both]
                                    [--workers 2]

Every version is run by `batchline run` (the synthetic engine at no cost per record, shards of
5,000, `--workers` local workers, a SQLite store and catalog, the warehouse on local disk) and
then published through the publish path the command line uses, the table's part timed alone:
the write of the version's branch (`stage`), then the publish that makes it main's snapshot and
records it. Bytes written are the sizes of the files the publish adds under the warehouse (data
files, manifests, metadata). `--where recent`: the changed records are the most recent ones (the
input's last), as a nightly change is; `random`: spread at random (a seeded choice); `both`: one
incremental version of each, each from the same full version (rolled back to between them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = ROOT / "examples" / "tickets" / "triage.schema.json"


def write_input(path: Path, records: int, changed: set[int]) -> None:
    with path.open("w") as f:
        for i in range(records):
            text = f"ticket {i}: printer on floor {i % 9} jams when printing from laptop {i % 13}"
            if i in changed:
                text += " (updated overnight)"
            f.write(json.dumps({"id": f"t-{i:08d}", "text": text, "acl": [f"team-{i % 5}"]}) + "\n")


def write_spec(path: Path, input_path: Path, base: str | None, folder: Path) -> None:
    output: dict[str, Any] = {"schema": str(SCHEMA), "label_field": "category",
                              "table": {"catalog": "store", "name": "bench.nightly",
                                        "warehouse": str(folder / "warehouse")}}
    spec = {"name": "nightly", "input": {"path": str(input_path), "acl_field": "acl"},
            "model": {"engine": "synthetic", "options": {}},
            "prompt": {"text": "Classify the ticket.", "version": "v1"}, "output": output,
            "shards": {"size": 5000}, "validate": {"drift": {"max_psi": 10, "max_new_categories": 10}}}
    if base is not None:
        spec["base"] = base
    path.write_text(yaml.safe_dump(spec))


def folder_bytes(folder: Path) -> dict[str, int]:
    out = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            p = Path(root) / name
            out[str(p)] = p.stat().st_size
    return out


def run(spec: Path, store: str, workers: int) -> str:
    done = subprocess.run([sys.executable, "-m", "batchline", "run", str(spec), "--store", store, "--workers",
                           str(workers)], check=True, capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip().splitlines()[-1]


def publish(store_url: str, version: str, folder: Path) -> dict[str, float]:
    """The publish, each target timed alone; and the bytes it added under `folder`."""
    from batchline.check.validate import validate
    from batchline.publish.pointer import publish as publish_version
    from batchline.spec import JobVersion, stored_spec
    from batchline.store import open_store
    from batchline.targets import targets_for

    store = open_store(store_url, create=False)
    try:
        assert validate(store, version).passed
        info = store.job(version)
        assert info is not None
        before = folder_bytes(folder / "warehouse")
        [target] = targets_for(stored_spec(info), store_url)
        start = time.perf_counter()
        target.stage(store, JobVersion.of(store, version))
        timed = {"stage": time.perf_counter() - start}
        start = time.perf_counter()
        publish_version(store, version)  # staged already: moves main and records the publication
        timed["show"] = time.perf_counter() - start
        timed["publish"] = timed["stage"] + timed["show"]
        after = folder_bytes(folder / "warehouse")
        timed["bytes"] = float(sum(size for path, size in after.items() if before.get(path) != size))
        return timed
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--changed", type=float, default=0.05)
    parser.add_argument("--where", choices=("recent", "random", "both"), default="both")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-nightly-"))
    store = f"sqlite:///{folder / 'store.db'}"
    n, k = args.records, int(args.records * args.changed)
    write_input(folder / "full.jsonl", n, set())
    write_spec(folder / "full.yaml", folder / "full.jsonl", None, folder)
    start = time.perf_counter()
    full = run(folder / "full.yaml", store, args.workers)
    print(f"full version {full}: {n:,} records run in {time.perf_counter() - start:.1f} s", flush=True)
    base = publish(store, full, folder)
    print(f"full publish: {json.dumps({k2: round(v, 2) for k2, v in base.items()})}", flush=True)
    rows = []
    for where in (["recent", "random"] if args.where == "both" else [args.where]):
        changed = set(range(n - k, n)) if where == "recent" else set(random.Random(7).sample(range(n), k))
        name = f"night-{where}"
        write_input(folder / f"{name}.jsonl", n, changed)
        write_spec(folder / f"{name}.yaml", folder / f"{name}.jsonl", full, folder)
        start = time.perf_counter()
        version = run(folder / f"{name}.yaml", store, args.workers)
        ran = time.perf_counter() - start
        timed = publish(store, version, folder)
        rows.append((where, ran, timed))
        print(f"incremental ({where}, {k:,} changed): run {ran:.1f} s, publish "
              f"{json.dumps({k2: round(v, 2) for k2, v in timed.items()})}", flush=True)
        # Back to the full version, so the next variant is measured from the same base.
        from batchline.publish.pointer import rollback
        from batchline.store import open_store

        s = open_store(store, create=False)
        rollback(s, "nightly")
        s.close()
    print()
    print(f"{n:,} records, {k:,} changed ({args.changed:.0%})")
    print(f"full publish: {base['publish']:.2f} s (branch {base['stage']:.2f} s, main and store "
          f"{base['show']:.2f} s), {base['bytes'] / 1e6:.1f} MB written")
    for where, _ran, timed in rows:
        print(f"incremental, {where}: {timed['publish']:.2f} s ({timed['publish'] / base['publish']:.3f} of the "
              f"full), {timed['bytes'] / 1e6:.1f} MB ({timed['bytes'] / base['bytes']:.3f} of the full)")
    print(f"command: python bench/nightly_publish.py --records {n} --changed {args.changed} --where {args.where} "
          f"--workers {args.workers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
