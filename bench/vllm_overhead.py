"""Overhead of batchline over vLLM: records/s through a batchline worker against a plain
`LLM.generate` over the same prompts, model, engine arguments and sampling parameters,
rounds interleaved in the same run. Runs in the vLLM environment (`make vllm-env`):

    .venv-vllm/bin/python bench/vllm_overhead.py [--records 200] [--rounds 3] [--max-num-seqs 32]

The model is the tests' tiny random Llama (hidden 256, 2 layers) on vLLM's CPU build,
answering a schema of enums and a short string at temperature 0. Loading the model is
left out of both sides (each loads in a fresh process, 20-30 s here): the plain side is
timed around `LLM.generate`, the worker from its first claim to the version's seal in the
store's event log (reading the slice, exact token counts, validation of every output and
the fenced writes included). A new input file each round makes a new job version. Prints
each round, the medians and their ratio.

Beside the wall clock, each side's CPU seconds over the same span, summed over its process
tree (the plain side's process and vLLM's engine core and worker; the batchline worker, its
engine child and vLLM's processes under it, sampled every 50 ms): on a shared machine whose
load moves the wall-clock ratio by tens of percent between rounds, CPU seconds per record
say what batchline itself adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchline.check.outputs import OutputChecker  # noqa: E402
from batchline.digests import sha256_tree  # noqa: E402
from batchline.engines.base import EngineConfig  # noqa: E402
from batchline.prompts.render import split_template  # noqa: E402
from batchline.spec import JobSpec, load_spec  # noqa: E402
from batchline.worker.shard import JobContext  # noqa: E402
from tests.integration.engines.support import save_tiny_llama  # noqa: E402
from tests.integration.engines.vllm_support import CPU_OPTIONS, ENDING_SCHEMA  # noqa: E402

RESULT = "plain side: "
PROMPT = "Triage the ticket as JSON: its category, whether it is urgent, and a tag.\n"


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of a process and every live descendant, by pid."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[int, float] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            kids = [int(x) for x in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            continue
        seconds[current] = (int(fields[11]) + int(fields[12])) / tick
        todo.extend(kids)
    return seconds


def write_job(tmp: Path, model: Path, records: int, round_no: int, max_num_seqs: int) -> Path:
    data = tmp / f"records-{round_no}.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i:05d}", "text": f"ticket {i} of round {round_no}: printer "
                                        f"{i % 13} jammed near room {i % 7}"}) + "\n" for i in range(records)))
    (tmp / "schema.json").write_text(json.dumps(ENDING_SCHEMA))
    spec = {
        "name": f"vllm-overhead-{round_no}",
        "input": {"path": str(data), "id_field": "id"},
        "model": {"engine": "vllm", "path": str(model), "digest": "sha256:" + sha256_tree(model),
                  "options": {**CPU_OPTIONS, "max_num_seqs": max_num_seqs}},
        "prompt": {"text": PROMPT, "version": "v1"},
        "decoding": {"temperature": 0, "max_tokens": 64, "seed": 0},
        "output": {"schema": str(tmp / "schema.json")},
        # One shard: the worker keeps 2 * batch_size records with vLLM, as many as it can run.
        "shards": {"size": records, "batch_size": max_num_seqs, "lease_seconds": 300},
    }
    path = tmp / f"job-{round_no}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def prompts(spec: JobSpec) -> list[str]:
    """Each record's prompt exactly as the worker renders it."""
    prefix, suffix = split_template(spec.prompt.text)
    job = JobContext(spec, OutputChecker(spec.output_schema), prefix, suffix)
    rows = [json.loads(line) for line in Path(spec.input.locations[0]).read_text().splitlines() if line.strip()]
    return [job.prompt(str(r["id"]), r["text"]) for r in rows]


def plain(spec_path: Path) -> dict[str, Any]:
    """In its own process: vLLM's LLM with the engine's arguments, one generate over every prompt."""
    import vllm
    from vllm.config import StructuredOutputsConfig

    from batchline.engines.vllm_engine import (
        engine_kwargs,
        make_sampling_params,
        sampling_kwargs,
        structured_outputs_config,
    )

    spec = load_spec(spec_path)
    config = EngineConfig(spec.model, spec.decoding, spec.output_schema)
    path = Path(spec.model.path or "")
    kwargs = engine_kwargs(config, path)
    kwargs["structured_outputs_config"] = structured_outputs_config(StructuredOutputsConfig, spec.model.options)
    llm = vllm.LLM(**kwargs)
    texts = prompts(spec)
    params = make_sampling_params(vllm, sampling_kwargs(config))
    # Text prompts: LLM.generate tokenizes them with the model's tokenizer, special tokens
    # added, as the engine does before it sends token ids (timed on both sides).
    cpu_before = tree_cpu(os.getpid())
    start = time.perf_counter()
    outputs = llm.generate(texts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    cpu_after = tree_cpu(os.getpid())
    cpu = sum(cpu_after.values()) - sum(cpu_before.get(pid, 0.0) for pid in cpu_after)
    checker = OutputChecker(spec.output_schema)
    valid = sum(1 for o in outputs if o.outputs[0].finish_reason == "stop"
                and checker.check(o.outputs[0].text.strip())[0] is not None)
    return {"seconds": seconds, "records": len(outputs), "valid": valid, "cpu": cpu}


def through_worker(spec_path: Path, store_url: str) -> dict[str, Any]:
    from batchline.plan.planner import plan
    from batchline.store import open_store

    store = open_store(store_url)
    spec = load_spec(spec_path)
    version = plan(spec, store).version
    worker = subprocess.Popen([sys.executable, "-m", "batchline", "worker", "--store", store_url, "--job", version],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    at_claim: dict[int, float] | None = None
    last: dict[int, float] = {}
    while worker.poll() is None:
        # The last sample of each process: they are gone once the worker has exited.
        last.update(tree_cpu(worker.pid))
        if at_claim is None and store.events(version, ["claim"]):
            at_claim = dict(last)
        time.sleep(0.05)
    assert worker.returncode == 0, f"the worker exited {worker.returncode}"
    cpu = sum(last.values()) - sum((at_claim or {}).get(pid, 0.0) for pid in last)
    claims = store.events(version, ["claim"])
    seal = store.events(version, ["seal"])
    assert claims and seal, "the version did not seal"
    results = sum(1 for _ in store.iter_results(version))
    dead = sum(1 for _ in store.iter_dead_letters(version))
    store.close()
    return {"seconds": seal[-1].ts - min(c.ts for c in claims), "records": results + dead, "valid": results,
            "cpu": cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--plain", type=Path, help=argparse.SUPPRESS)  # the plain side's own process
    args = parser.parse_args()
    if args.plain is not None:
        # vLLM logs on stdout too (its shutdown after this line): the figures are the marked line.
        print(RESULT + json.dumps(plain(args.plain)), flush=True)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = tmp / "tiny-llama"
    save_tiny_llama(model, hidden_size=256)
    store_url = f"sqlite:///{tmp / 'store.db'}"
    plain_rates, worker_rates, plain_cpu, worker_cpu = [], [], [], []
    for i in range(args.rounds):
        spec_path = write_job(tmp, model, args.records, i, args.max_num_seqs)
        done = subprocess.run([sys.executable, __file__, "--plain", str(spec_path)], check=True,
                              capture_output=True, text=True)
        raw = json.loads(next(line for line in done.stdout.splitlines() if line.startswith(RESULT))[len(RESULT):])
        worker = through_worker(spec_path, store_url)
        plain_rates.append(raw["records"] / raw["seconds"])
        worker_rates.append(worker["records"] / worker["seconds"])
        plain_cpu.append(1000 * raw["cpu"] / raw["records"])
        worker_cpu.append(1000 * worker["cpu"] / worker["records"])
        print(f"round {i + 1}: LLM.generate {plain_rates[-1]:.1f} records/s, {plain_cpu[-1]:.1f} CPU ms/record "
              f"({raw['valid']}/{raw['records']} valid); batchline worker {worker_rates[-1]:.1f} records/s, "
              f"{worker_cpu[-1]:.1f} CPU ms/record ({worker['valid']} results, "
              f"{worker['records'] - worker['valid']} dead letters)", flush=True)
    raw_median, worker_median = statistics.median(plain_rates), statistics.median(worker_rates)
    print(f"{args.records} records, max_num_seqs {args.max_num_seqs}, medians of {args.rounds} interleaved rounds")
    print(f"LLM.generate:     {raw_median:.1f} records/s")
    print(f"batchline worker: {worker_median:.1f} records/s")
    print(f"ratio: {worker_median / raw_median:.3f} of LLM.generate's throughput")
    per_round = [w / r for w, r in zip(worker_rates, plain_rates, strict=True)]
    print(f"ratio per round: {', '.join(f'{x:.3f}' for x in per_round)}")
    print(f"CPU per record: LLM.generate {statistics.median(plain_cpu):.2f} ms, batchline worker "
          f"{statistics.median(worker_cpu):.2f} ms (medians); LLM.generate's CPU over the worker's: "
          f"{statistics.median(plain_cpu) / statistics.median(worker_cpu):.3f}")
    print("command: .venv-vllm/bin/python bench/vllm_overhead.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
