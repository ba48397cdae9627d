"""Prefix caching in the llamacpp engine: records/s with a shared ~500-token
instruction prefix kept in llama.cpp's cache, against the same work with the
cache dropped before every record.

    python bench/prefix_cache.py [--records 16] [--threads N] [--prefix-tokens 500]

Uses the packaged Gemma 3 270M (Q4_K_M) on the CPU, the example triage prompt
cut to about 500 tokens, the example schema, and tickets from
examples/tickets/tickets.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchline.engines.base import EngineConfig, EngineRequest  # noqa: E402
from batchline.engines.llamacpp import LlamaCppEngine, default_threads  # noqa: E402
from batchline.engines.models import GEMMA_PACKAGE, packaged_model_digest  # noqa: E402
from batchline.prompts.render import render, split_template  # noqa: E402
from batchline.spec import DecodingSpec, ModelSpec  # noqa: E402

EXAMPLES = ROOT / "examples" / "tickets"


def short_prefix(engine: LlamaCppEngine, target: int) -> str:
    """The triage prompt's instructions and as many of its examples as fit in `target` tokens."""
    prefix, _ = split_template((EXAMPLES / "triage.prompt").read_text(encoding="utf-8"))
    head, *examples = prefix.split("\n<record>\n")
    kept = head
    for example in examples:
        candidate = kept + "\n<record>\n" + example
        if engine.count_tokens(candidate) > target:
            break
        kept = candidate
    return kept.rstrip("\n") + "\n\n"


def tickets(n: int) -> list[tuple[str, str]]:
    rows = []
    with (EXAMPLES / "tickets.jsonl").open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if 80 <= len(row["text"]) <= 400:  # typical tickets; the long tail would dominate
                rows.append((row["id"], row["text"]))
            if len(rows) == n:
                break
    return rows


def run(engine: LlamaCppEngine, requests: list[EngineRequest], cached: bool) -> tuple[float, float]:
    evaluated_before = engine.stats["prompt_tokens_evaluated"]
    started = time.perf_counter()
    for request in requests:
        if not cached:
            engine._forget_cache()
        outcome = engine.run_one(request)
        if outcome.error:
            raise SystemExit(f"{request.record_id}: {outcome.error}")
    return time.perf_counter() - started, engine.stats["prompt_tokens_evaluated"] - evaluated_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--prefix-tokens", type=int, default=500)
    args = parser.parse_args()
    command = "python bench/prefix_cache.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    schema = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))
    config = EngineConfig(
        model=ModelSpec(engine="llamacpp", digest=packaged_model_digest(GEMMA_PACKAGE),
                        options={"n_threads": args.threads, "calibrate_choices": False}),
        decoding=DecodingSpec(temperature=0.0, max_tokens=120, seed=0),
        output_schema=schema,
    )
    engine = LlamaCppEngine(config)
    engine.load()
    prefix = short_prefix(engine, args.prefix_tokens)
    requests = [EngineRequest(record_id=rid, prompt=render(prefix, "", text), prefix=prefix, text=text)
                for rid, text in tickets(args.records)]
    prompt_tokens = sum(engine.count_tokens(r.prompt) for r in requests)
    engine.run_one(requests[0])  # warm-up, and the prefix into the cache

    # Alternate the two modes so that a neighbour's load on the machine hits both alike.
    times = {True: 0.0, False: 0.0}
    evaluated = {True: 0.0, False: 0.0}
    half = len(requests) // 2
    for cached, part in ((False, requests[:half]), (True, requests[:half]),
                         (True, requests[half:]), (False, requests[half:])):
        if cached:
            engine.run_one(part[0])  # puts the shared prefix back into the cache
        seconds, tokens = run(engine, part, cached)
        times[cached] += seconds
        evaluated[cached] += tokens
    n = len(requests)
    cached_rate, uncached_rate = n / times[True], n / times[False]
    print(f"prefix: {engine.count_tokens(prefix)} tokens; {n} records, {prompt_tokens / n:.0f} prompt tokens "
          f"per record on average; {args.threads} threads")
    print(f"prefix cached:   {cached_rate:.2f} records/s ({evaluated[True] / n:.0f} prompt tokens evaluated per record)")
    print(f"cache defeated:  {uncached_rate:.2f} records/s ({evaluated[False] / n:.0f} prompt tokens evaluated per record)")
    print(f"ratio: {cached_rate / uncached_rate:.2f}x")
    print(f"command: {command}")


if __name__ == "__main__":
    main()
