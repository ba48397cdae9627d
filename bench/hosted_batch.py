"""A hosted route's own cost: planning with routing, and collecting a finished batch.

    python bench/hosted_batch.py [--records 200000] [--batch 20000] [--store sqlite:///...]

1. Planning: the same input planned with and without routing (a quarter of the
   records cleared for a provider); prints both times and their ratio, the
   price of reading the class field and cutting shards per route.
2. Collecting: one shard of `--batch` cleared records is run by a real worker
   against the OpenAI stand-in (tests/fakes/provider_servers.py, which answers
   at once), from the claim to the sealed version: building and uploading the
   batch file, polling, downloading the output file, validating every answer
   against the schema and writing the results. Prints records per second; a
   worker must get through its largest batch well inside its lease.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchline.plan.planner import plan  # noqa: E402
from batchline.spec import load_spec  # noqa: E402
from batchline.store import open_store  # noqa: E402
from batchline.worker.supervisor import Worker  # noqa: E402
from tests.fakes.provider_servers import openai_batch_server  # noqa: E402

SCHEMA = ROOT / "examples" / "tickets" / "triage.schema.json"
ANSWER = json.dumps({"category": "Hardware", "summary": "printer jams", "entities": ["printer"]})


def write_input(path: Path, records: int, cleared_every: int) -> None:
    with path.open("w") as f:
        for i in range(records):
            cls = "public" if i % cleared_every == 0 else "restricted"
            f.write(json.dumps({"id": f"t-{i:08d}", "text": f"ticket {i}: printer on floor {i % 9} jams",
                                "data_class": cls}) + "\n")


def write_spec(path: Path, input_path: Path, routing: dict[str, object] | None, shard: int) -> Path:
    spec: dict[str, object] = {
        "name": "hosted-bench", "input": {"path": str(input_path)},
        "model": {"engine": "synthetic"}, "prompt": {"text": "Classify the ticket.", "version": "v1"},
        "output": {"schema": str(SCHEMA)}, "shards": {"size": shard, "lease_seconds": 600},
    }
    if routing:
        spec["routing"] = routing
    path.write_text(yaml.safe_dump(spec))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--store", default=None, help="store URL (default: a SQLite file in a temporary folder)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, openai_batch_server(answer=lambda _id, _body: ANSWER) as server:
        d = Path(tmp)
        os.environ["BENCH_PROVIDER_KEY"] = server.api_key
        routing = {"class_field": "data_class", "providers": {"oai": {
            "api": "openai", "model": "gpt-4o-mini", "classes": ["public"], "retention": "30 days",
            "base_url": server.base_url, "api_key_env": "BENCH_PROVIDER_KEY", "poll_seconds": 0.05,
            "shard_size": args.batch}}}

        input_path = d / "in.jsonl"
        write_input(input_path, args.records, 4)
        timings = {}
        for name, rules in (("without routing", None), ("with routing", routing)):
            store = open_store(args.store or f"sqlite:///{d / (name.replace(' ', '_') + '.db')}")
            spec = load_spec(write_spec(d / f"{name.replace(' ', '_')}.yaml", input_path, rules, 5000))
            start = time.perf_counter()
            plan(spec, store)
            timings[name] = time.perf_counter() - start
            store.close()
        print(f"planning {args.records:,} records (5,000 per shard; a quarter cleared for the provider):")
        for name, seconds in timings.items():
            print(f"  {name:16} {seconds:6.2f} s  {args.records / seconds:10,.0f} records/s")
        print(f"  ratio            {timings['with routing'] / timings['without routing']:6.3f}")

        batch_input = d / "batch.jsonl"
        write_input(batch_input, args.batch, 1)
        store = open_store(args.store or f"sqlite:///{d / 'collect.db'}")
        spec = load_spec(write_spec(d / "collect.yaml", batch_input, routing, 5000))
        version = plan(spec, store).version
        start = time.perf_counter()
        code = Worker(store, version=version, poll_seconds=0.02).run()
        seconds = time.perf_counter() - start
        info = store.job(version)
        assert code == 0 and info is not None and info.state == "sealed", "the batch did not complete"
        print(f"one hosted batch of {args.batch:,} records, claim to sealed (submit, poll, download, validate, "
              f"write), {Path(spec.input.locations[0]).name} on {store.url.split(':')[0]}:")
        print(f"  {seconds:6.2f} s  {args.batch / seconds:10,.0f} records/s  ({len(server.submissions)} batch)")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
