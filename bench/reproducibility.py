"""Reproducibility of a real engine: a job run by a batchline worker, then its results recomputed
by the validator's check (a fresh engine process) in batches of the workers' own size and of the
check's default size, each compared with the stored answers.

    python bench/reproducibility.py --engine llamacpp [--records 100]
    .venv-vllm/bin/python bench/reproducibility.py --engine vllm [--records 200]

llamacpp: the demo job (examples/tickets/job.yaml: Gemma 3 270M Q4_K_M, schema-constrained, on
the CPU) over the first N of its tickets, the workers' batches of 8. vllm: the vLLM tests' tiny
random Llama (hidden 256, 2 layers) on vLLM's CPU build, a schema of enums and a short string,
the workers' batches of 32 (max_num_seqs 32). Both at temperature 0, one worker, a SQLite store.
Prints, for each batch size the check runs in, the share of every recomputed record whose whole
output, and whose label, agree with what the worker stored.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchline.check.reproduce import check_reproducible  # noqa: E402
from batchline.spec import ReproduceSpec, stored_spec  # noqa: E402
from batchline.store import open_store  # noqa: E402
from batchline.worker.recompute import recompute  # noqa: E402


def llamacpp_job(tmp: Path, records: int) -> Path:
    examples = ROOT / "examples" / "tickets"
    spec = yaml.safe_load((examples / "job.yaml").read_text())
    data = tmp / "tickets.jsonl"
    data.write_text("".join((examples / "demo.jsonl").read_text().splitlines(keepends=True)[:records]))
    spec["input"]["path"] = str(data)
    spec["prompt"]["file"] = str(examples / spec["prompt"]["file"])
    spec["prompt"]["examples"]["file"] = str(examples / spec["prompt"]["examples"]["file"])
    spec["output"]["schema"] = str(examples / spec["output"]["schema"])
    spec.pop("validate", None)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def vllm_job(tmp: Path, records: int) -> Path:
    from batchline.digests import sha256_tree
    from tests.integration.engines.support import save_tiny_llama
    from tests.integration.engines.vllm_support import CPU_OPTIONS, ENDING_SCHEMA

    model = tmp / "tiny-llama"
    save_tiny_llama(model, hidden_size=256)
    data = tmp / "records.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i:05d}", "text": f"ticket {i}: printer {i % 13} jammed near "
                                        f"room {i % 7}"}) + "\n" for i in range(records)))
    (tmp / "schema.json").write_text(json.dumps(ENDING_SCHEMA))
    spec = {
        "name": "reproducibility-vllm",
        "input": {"path": str(data), "id_field": "id"},
        "model": {"engine": "vllm", "path": str(model), "digest": "sha256:" + sha256_tree(model),
                  "options": {**CPU_OPTIONS, "max_num_seqs": 32}},
        "prompt": {"text": "Triage the ticket as JSON: its category, whether it is urgent, and a tag.\n",
                   "version": "v1"},
        "decoding": {"temperature": 0, "max_tokens": 64, "seed": 0},
        "output": {"schema": str(tmp / "schema.json"), "label_field": "category"},
        "shards": {"size": records, "batch_size": 32, "lease_seconds": 600},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("llamacpp", "vllm"), required=True)
    parser.add_argument("--records", type=int, default=100)
    parser.add_argument("--batch-sizes", default="", help="the check's batch sizes (default: the workers' and 1)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-reproducibility-"))
    spec_path = (llamacpp_job if args.engine == "llamacpp" else vllm_job)(tmp, args.records)
    store_url = f"sqlite:///{tmp / 'store.db'}"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "batchline", "run", str(spec_path), "--store", store_url,
                           "--workers", "1"], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    version = done.stdout.strip().splitlines()[-1]
    print(f"{version}: {args.records} records run by one worker in {time.monotonic() - started:.0f} s")
    store = open_store(store_url, create=False)
    info = store.job(version)
    assert info is not None
    spec = stored_spec(info)
    workers = spec.shards.batch_size
    sizes = [int(x) for x in args.batch_sizes.split(",") if x] or [workers, 1]
    rows: list[dict[str, Any]] = []
    for size in sizes:
        t0 = time.monotonic()
        check = check_reproducible(store, version, spec, ReproduceSpec(sample=args.records, batch_size=size), recompute)
        d = check.details
        rows.append({"batch_size": size, "compared": d["sample"], "exact": d["exact_agreement"],
                     "label": d["label_agreement"], "failed": d["failed"], "seconds": time.monotonic() - t0,
                     "runtime": d["runtime"], "disagreements": d["disagreements"][:3]})
        print(f"check in batches of {size} (the workers' {workers}): {d['sample']} recomputed, exact "
              f"{d['exact_agreement']:.1%}, label {d['label_agreement'] if d['label_agreement'] is None else format(d['label_agreement'], '.1%')}, "
              f"no answer {d['failed']}, {rows[-1]['seconds']:.0f} s; runtime {d['runtime']}", flush=True)
        for line in d["disagreements"][:3]:
            print(f"    {line}")
    print(json.dumps({"engine": args.engine, "version": version, "workers_batch_size": workers, "rows": rows}))
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
