"""Three routes, several workers, both providers' stand-ins, faults at the providers.

    python bench/hosted_fleet.py [--records 3000] [--workers 4] [--store URL]

A third of the records is cleared for OpenAI, a third for Anthropic, a third
stays local (the synthetic engine). The OpenAI stand-in lets 1% of its
requests expire in every batch and the Anthropic one errors 0.5%; both keep
each batch in progress for a few polls. `batchline run` drives the workers
until the version seals. Prints the wall time, the outcomes by kind, how many
batches and request lines each provider received, and the coverage check.
The stand-ins are the test fakes of tests/fakes/provider_servers.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchline.store import open_store  # noqa: E402
from tests.fakes.provider_servers import anthropic_batch_server, openai_batch_server  # noqa: E402

SCHEMA = ROOT / "examples" / "tickets" / "triage.schema.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--store", default=None, help="an empty store's URL (default: a SQLite file in a temporary "
                                                      "folder); a store that has run it once finds it sealed")
    args = parser.parse_args()
    classes = ["public", "internal", "secret"]
    with tempfile.TemporaryDirectory() as tmp, openai_batch_server() as oai, anthropic_batch_server() as ant:
        d = Path(tmp)
        with (d / "in.jsonl").open("w") as f:
            for i in range(args.records):
                f.write(json.dumps({"id": f"t{i:07d}", "text": f"ticket {i}: printer {i % 7} jams",
                                    "data_class": classes[i % 3]}) + "\n")
        os.environ["BENCH_OPENAI_KEY"], os.environ["BENCH_ANTHROPIC_KEY"] = oai.api_key, ant.api_key
        oai.complete_after_polls, ant.complete_after_polls = 2, 3
        oai.expire_ids = {f"t{i:07d}" for i in range(0, args.records, 300)}
        ant.error_ids = {f"t{i:07d}" for i in range(1, args.records, 600)}
        common = {"retention": "30 days", "poll_seconds": 0.3}
        (d / "job.yaml").write_text(yaml.safe_dump({
            "name": "hosted-fleet", "input": {"path": str(d / "in.jsonl")}, "model": {"engine": "synthetic"},
            "prompt": {"text": "Classify the ticket.", "version": "v1"}, "output": {"schema": str(SCHEMA)},
            "shards": {"size": 200, "max_attempts": 2},
            "routing": {"class_field": "data_class", "providers": {
                "oai": {"api": "openai", "model": "gpt-4o-mini", "classes": ["public"], "base_url": oai.base_url,
                        "api_key_env": "BENCH_OPENAI_KEY", "shard_size": 150, **common},
                "ant": {"api": "anthropic", "model": "claude-haiku-4-5", "classes": ["internal"],
                        "base_url": ant.base_url, "api_key_env": "BENCH_ANTHROPIC_KEY", "shard_size": 250,
                        **common}}}}, sort_keys=False))
        url = args.store or f"sqlite:///{d / 'fleet.db'}"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "batchline", "run", str(d / "job.yaml"), "--store", url,
                        "--workers", str(args.workers)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        store = open_store(url)
        version = next(j.version for j in store.jobs() if j.name == "hosted-fleet")
        st, cov = store.status(version), store.coverage(version)
        print(f"{args.records:,} records, {args.workers} workers on {url.split(':')[0]}: sealed in {seconds:.1f} s")
        print(f"  results {st.results:,}, dead letters {st.dead_letters:,} {st.dead_letters_by_kind}")
        for name, server in (("openai", oai), ("anthropic", ant)):
            lines = [line["custom_id"] for s in server.submissions for line in s["lines"]]
            print(f"  {name}: {len(server.submissions)} batches, {len(lines):,} request lines for "
                  f"{len(set(lines)):,} records")
        print(f"  coverage: {cov.missing} missing, {cov.unexpected} unexpected, {cov.both} with both")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
