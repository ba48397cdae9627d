"""Pipeline overhead: the same records through the raw engine in a plain loop and
through `batchline run`, same engine and settings, runs interleaved.

    python bench/engine_overhead.py [--spec examples/tickets/job.yaml] [--records 48] [--rounds 3]

Both sides include loading the model (and the engine's one-off work, such as
calibrating choices) and end when the last record has its answer: the raw loop
when the engine yields it, `batchline run` when the version is sealed (planning,
the worker process, the engine child, validation of every output and the
fenced writes included). Prints records/s for each, medians over the rounds,
and their ratio.
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
from typing import Any

import yaml

from batchline.check.outputs import OutputChecker
from batchline.engines import create_engine
from batchline.engines.base import EngineConfig, EngineRequest, ListRequestSource
from batchline.prompts.render import split_template
from batchline.spec import load_spec
from batchline.worker.shard import JobContext

ROOT = Path(__file__).resolve().parents[1]


def raw_requests(spec_path: Path) -> list[EngineRequest]:
    """The records' requests as the worker builds them (its own rendering, retrieved
    examples included), so both sides send the engine the same prompts."""
    spec = load_spec(spec_path)
    records = [json.loads(line) for line in Path(spec.input.locations[0]).read_text().splitlines() if line.strip()]
    prefix, suffix = split_template(spec.prompt.text)
    job = JobContext(spec, OutputChecker(spec.output_schema), prefix, suffix)
    return [EngineRequest(str(r[spec.input.id_field]), job.prompt(str(r[spec.input.id_field]), r[spec.input.text_field]),
                          prefix, r[spec.input.text_field]) for r in records]


def round_spec(base: dict[str, Any], spec_dir: Path, data: Path) -> dict[str, Any]:
    """The base spec over another input, every file it names made absolute (it is written
    elsewhere)."""
    spec = dict(base)
    spec["input"] = {**base["input"], "path": str(data)}
    spec["prompt"] = {**base["prompt"], "file": str(spec_dir / base["prompt"]["file"])}
    if "examples" in base["prompt"]:
        examples = base["prompt"]["examples"]
        spec["prompt"]["examples"] = {**examples, "file": str(spec_dir / examples["file"])}
    spec["output"] = {**base["output"], "schema": str(spec_dir / base["output"]["schema"])}
    spec.pop("validate", None)
    return spec


def raw_loop(spec_path: Path) -> float:
    spec = load_spec(spec_path)
    start = time.perf_counter()
    requests = raw_requests(spec_path)  # timed: the pipeline renders them (and retrieves the examples) too
    engine = create_engine(EngineConfig(spec.model, spec.decoding, spec.output_schema))
    engine.load()
    answered = sum(1 for _ in engine.generate(ListRequestSource(requests)))
    seconds = time.perf_counter() - start
    engine.close()
    assert answered == len(requests)
    return len(requests) / seconds


def pipeline(spec_path: Path, store: str) -> float:
    n = sum(1 for line in Path(load_spec(spec_path).input.locations[0]).read_text().splitlines() if line.strip())
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "batchline", "run", str(spec_path), "--store", store, "--workers", "1"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return n / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "tickets" / "job.yaml")
    parser.add_argument("--records", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    base = yaml.safe_load(args.spec.read_text())
    source = Path(load_spec(args.spec).input.locations[0])
    lines = [line for line in source.read_text().splitlines() if line.strip()][:args.records]
    raw_rates, pipe_rates = [], []
    for i in range(args.rounds):
        # A new input file each round is a new job version, so nothing is carried or skipped.
        data = tmp / f"records-{i}.jsonl"
        data.write_text("".join(json.dumps({**json.loads(line), "round": i}) + "\n" for line in lines))
        path = tmp / f"job-{i}.yaml"
        path.write_text(yaml.safe_dump(round_spec(base, args.spec.parent, data)))
        raw_rates.append(raw_loop(path))
        pipe_rates.append(pipeline(path, f"sqlite:///{tmp / 'store.db'}"))
        print(f"round {i + 1}: raw {raw_rates[-1]:.3f} records/s, batchline run {pipe_rates[-1]:.3f} records/s",
              flush=True)
    raw, pipe = statistics.median(raw_rates), statistics.median(pipe_rates)
    print(f"{args.records} records, engine {base['model']['engine']}, medians of {args.rounds} interleaved rounds")
    print(f"raw engine loop: {raw:.3f} records/s")
    print(f"batchline run:   {pipe:.3f} records/s")
    print(f"ratio: {pipe / raw:.3f} of the raw engine's throughput")
    print("command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
