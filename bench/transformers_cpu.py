"""The transformers engine on the CPU with schema-constrained decoding: slots, records/s, grammar cost.

The tiny random Llama of the engine tests (tests/integration/engines/support.py: 2 layers,
a BPE tokenizer trained on the example prompt) answers example tickets with
the example prompt (about 1,300 tokens, most of them the shared prefix) and
the triage schema, greedy, under three settings of the engine:

  plain    prefix_cache false, refill false (the engine before this change)
  prefix   the prefix computed once, static batches
  refill   the prefix computed once, finished rows refilled (the default)

and checks that all three give the same tokens. Random weights make the
grammar refuse most greedy choices, so the grammar's share here is an upper
bound: a trained model proposes valid tokens at most steps. Wall time on a
shared 2-core machine is noisy; the slot counts are exact.

    python bench/transformers_cpu.py --records 24 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchline.digests import sha256_tree
from batchline.engines.base import EngineConfig, ListRequestSource
from batchline.engines.transformers_engine import TransformersEngine
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import (
    EXAMPLES,
    make_request,
    save_tiny_llama,
    triage_template,
)

MODES = {
    "plain": {"prefix_cache": False, "refill": False},
    "prefix": {"prefix_cache": True, "refill": False},
    "refill": {"prefix_cache": True, "refill": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--records", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    command = "python bench/transformers_cpu.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    schema = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))
    prefix, suffix = triage_template()
    with (EXAMPLES / "tickets.jsonl").open(encoding="utf-8") as lines:
        tickets = [json.loads(line) for _, line in zip(range(args.records), lines, strict=False)]
    requests = [make_request(t["id"], prefix, t["text"], suffix) for t in tickets]
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_tiny_llama(path)
        digest = "sha256:" + sha256_tree(path)
        for mode, options in MODES.items():
            engine = TransformersEngine(EngineConfig(
                model=ModelSpec(engine="transformers", path=str(path), digest=digest,
                                options={"device": "cpu", "batch_size": args.batch_size, **options}),
                decoding=DecodingSpec(temperature=0.0, max_tokens=400, seed=0),
                output_schema=schema,
            ))
            engine.load()
            started = time.perf_counter()
            outcomes = list(engine.generate(ListRequestSource(requests)))
            elapsed = time.perf_counter() - started
            engine.close()
            outputs[mode] = {o.record_id: (o.output, o.output_tokens) for o in outcomes}
            lengths = [o.output_tokens or 0 for o in outcomes]
            failed = sum(o.error is not None for o in outcomes)
            c = engine.counts
            print(f"{mode:6s}: {len(outcomes)} records in {elapsed:5.1f}s = {len(outcomes) / elapsed:5.2f} records/s "
                  f"({failed} failed), output {min(lengths)}-{max(lengths)} tokens; decode slots {c.decode_rows}, "
                  f"{c.idle_rows} on finished rows; prompt tokens run {c.prefill_tokens}, reused {c.reused_tokens}; "
                  f"grammar {c.grammar_seconds:.1f}s ({c.grammar_seconds / elapsed:.0%} of the time), "
                  f"choice refused at {c.masked_rows / max(1, c.decode_rows - c.idle_rows + len(outcomes)):.0%} "
                  f"of row-steps", flush=True)
    same = all(outputs[mode] == outputs["plain"] for mode in MODES)
    print(f"same tokens in every mode: {'yes' if same else 'NO'}")
    print(f"command: {command}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
