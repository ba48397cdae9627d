"""Ticket triage with the llamacpp engine: accuracy against the agents' labels,
schema-valid outputs on the first attempt, and speed, constrained or not.

    python bench/triage_quality.py [--records 300] [--seed 1] [--mode calibrated|constrained|unconstrained]
                                   [--examples K] [--example-chars N] [--strength S]

Reads ../shared/data/it-service-tickets.csv.gz when it is there (a random
sample of its 47,837 rows), else the project's own sample
examples/tickets/tickets.jsonl; ticket texts are cut at 1,000 characters.
The majority class (Hardware) is 28% of the tickets.

--mode vote --examples K answers each ticket with the label most of its K
nearest examples carry, without the model.

--examples K shows each ticket the K nearest labelled tickets of the project's
sample (examples/tickets/tickets.jsonl, as `prompt.examples` does), leaving out
every ticket evaluated here, by id and by text.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import random
import shlex
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchline.engines.base import EngineConfig, EngineRequest  # noqa: E402
from batchline.engines.llamacpp import LlamaCppEngine  # noqa: E402
from batchline.engines.models import GEMMA_PACKAGE, packaged_model_digest  # noqa: E402
from batchline.prompts.examples import Example, ExampleIndex  # noqa: E402
from batchline.prompts.render import render, split_template  # noqa: E402
from batchline.spec import DecodingSpec, ModelSpec  # noqa: E402

EXAMPLES = ROOT / "examples" / "tickets"
SHARED = ROOT.parent / "shared" / "data" / "it-service-tickets.csv.gz"


def sample(n: int, seed: int) -> tuple[list[tuple[str, str, str]], str]:
    if SHARED.exists():
        with gzip.open(SHARED, "rt", encoding="utf-8") as f:
            rows = [(f"t-{i + 1:06d}", r["Document"], r["Topic_group"]) for i, r in enumerate(csv.DictReader(f))]
        source = str(SHARED)
    else:
        with (EXAMPLES / "tickets.jsonl").open(encoding="utf-8") as f:
            rows = [(r["id"], r["text"], r["label"]) for r in map(json.loads, f)]
        source = str(EXAMPLES / "tickets.jsonl")
    return random.Random(seed).sample(rows, n), source


def example_pool(rows: list[tuple[str, str, str]]) -> list[Example]:
    """The project's labelled sample less every ticket evaluated here, by id and by text."""
    ids, texts = {rid for rid, _, _ in rows}, {text for _, text, _ in rows}
    with (EXAMPLES / "tickets.jsonl").open(encoding="utf-8") as f:
        return [Example(r["id"], r["text"], r["label"]) for r in map(json.loads, f)
                if r["id"] not in ids and r["text"] not in texts]


def vote(args: argparse.Namespace, command: str) -> None:
    if not args.examples:
        raise SystemExit("--mode vote needs --examples K")
    rows, source = sample(args.records, args.seed)
    index = ExampleIndex(example_pool(rows), args.examples)
    correct = 0
    for rid, text, label in rows:
        labels = [e.label for e in index.nearest(rid, text[:1000])]
        counts = collections.Counter(labels)
        top = max(counts.values(), default=0)
        answer = next((x for x in labels if counts[x] == top), None)
        correct += answer == label
    print(f"{len(rows)} tickets from {source} (seed {args.seed}); no model: the majority label of the "
          f"{args.examples} nearest of {len(index.items)} examples")
    print(f"accuracy: {correct / len(rows):.1%} (majority class 28.5%)")
    print(f"command: {command}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=["calibrated", "constrained", "unconstrained", "vote"], default="calibrated",
                        help="vote: no model; the label most of the --examples nearest carry (the nearest breaks "
                             "ties), the reference the model's answers are measured against")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--examples", type=int, default=0, help="retrieved examples per ticket (0: none)")
    parser.add_argument("--example-chars", type=int, default=150, help="an example's text is cut here")
    parser.add_argument("--strength", type=float, help="calibration_strength (the engine's default if unset)")
    args = parser.parse_args()
    command = "python bench/triage_quality.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    schema = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))
    options: dict[str, object] = {
        "constrained": args.mode != "unconstrained",
        "calibrate_choices": args.mode == "calibrated",
    }
    if args.threads:
        options["n_threads"] = args.threads
    if args.strength is not None:
        options["calibration_strength"] = args.strength
    if args.mode == "vote":
        vote(args, command)
        return
    config = EngineConfig(
        model=ModelSpec(engine="llamacpp", digest=packaged_model_digest(GEMMA_PACKAGE), options=options),
        decoding=DecodingSpec(temperature=0.0, max_tokens=200, seed=0),
        output_schema=schema,
    )
    engine = LlamaCppEngine(config)
    engine.load()
    prefix, suffix = split_template((EXAMPLES / "triage.prompt").read_text(encoding="utf-8"))
    rows, source = sample(args.records, args.seed)
    gold = {rid: label for rid, _, label in rows}
    index = None
    if args.examples:
        index = ExampleIndex(example_pool(rows), args.examples, args.example_chars)

    started = time.perf_counter()
    correct = valid = 0
    predicted: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    for rid, text, _ in rows:
        text = text[:1000]
        shown = index.render(rid, text, "category") if index else ""
        outcome = engine.run_one(EngineRequest(rid, render(prefix, suffix, text, shown), prefix, text))
        try:
            if outcome.error:
                raise ValueError(outcome.error)
            answer = json.loads(outcome.output or "")
            jsonschema.validate(answer, schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{rid}: {' '.join(str(exc).split())[:120]}")
            continue
        valid += 1
        predicted[answer["category"]] += 1
        correct += answer["category"] == gold[rid]
    elapsed = time.perf_counter() - started
    s = engine.stats
    n = len(rows)
    print(f"{n} tickets from {source} (seed {args.seed}), mode {args.mode}, {engine.n_threads} threads, "
          f"calibration strength {engine.calibration_strength}, "
          + (f"{args.examples} retrieved examples from {len(index.items)}, cut at {index.max_chars} "
             "characters" if index else "no retrieved examples"))
    print(f"accuracy: {correct / n:.1%} (majority class 28.5%); schema-valid on first attempt: {valid}/{n} "
          f"({valid / n:.1%})")
    print(f"speed: {n / elapsed:.2f} records/s; decoding {s['output_tokens'] / s['decode_seconds']:.1f} output "
          f"tokens/s ({s['decode_steps'] / s['decode_seconds']:.1f} sampled steps/s, "
          f"{s['forced_tokens'] / max(1, s['output_tokens']):.0%} of output tokens forced by the schema, "
          f"mask needed at {s['masked_steps'] / max(1, s['decode_steps']):.0%} of steps); prompt "
          f"{s['prompt_tokens_evaluated'] / s['prompt_seconds']:.0f} tokens/s evaluated, "
          f"{1 - s['prompt_tokens_evaluated'] / s['prompt_tokens']:.0%} of prompt tokens reused from the cache")
    print(f"output tokens per record: {s['output_tokens'] / n:.1f}; predicted: {dict(predicted.most_common())}")
    if failures:
        print("failures:", *failures[:5], sep="\n  ")
    print(f"command: {command}")


if __name__ == "__main__":
    main()
