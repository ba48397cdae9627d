"""Can the transformers engine run on transformers' own continuous batching?

Measures, on the CPU and the tiny random Llama of the engine tests (example tickets with
the example prompt, about 2,540 prompt tokens, greedy), the engine's own loop (refill:
finished rows replaced, the prefix computed once) against `generate_batch` (transformers'
ContinuousBatchingManager with paged attention, "paged|sdpa"), both unconstrained: records/s,
decode slots (rows decoded, summed over the steps), and whether the tokens agree (EOS
ignored, so both decode exactly --max-tokens). Then
asks `generate_batch` to keep the schema: its logits processors are the ones its generation
config implies, and a processor that is not of its per-request kind is called with the whole
packed batch's token ids, so no per-record grammar state can be kept (printed with what
happened).

    python bench/transformers_cb.py --records 24 --batch-size 8 --max-tokens 60
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--records", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=60)
    args = parser.parse_args()
    command = "python bench/transformers_cb.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor

    prefix, suffix = triage_template()
    with (EXAMPLES / "tickets.jsonl").open(encoding="utf-8") as lines:
        tickets = [json.loads(line) for _, line in zip(range(args.records), lines, strict=False)]
    requests = [make_request(t["id"], prefix, t["text"], suffix) for t in tickets]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_tiny_llama(path)
        engine = TransformersEngine(EngineConfig(
            model=ModelSpec(engine="transformers", path=str(path), digest="sha256:" + sha256_tree(path),
                            options={"device": "cpu", "batch_size": args.batch_size, "constrained": False,
                                     "ignore_eos": True}),
            decoding=DecodingSpec(temperature=0.0, max_tokens=args.max_tokens, seed=0),
            output_schema={"type": "object"},
        ))
        engine.load()
        started = time.perf_counter()
        outcomes = {o.record_id: o for o in engine.generate(ListRequestSource(requests))}
        own_seconds = time.perf_counter() - started
        engine.close()
        counts = engine.counts
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="paged|sdpa",
                                                     dtype=torch.float32)
        config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        prompts = [tokenizer(r.prompt, add_special_tokens=True)["input_ids"] for r in requests]
        started = time.perf_counter()
        batch = model.generate_batch(inputs=prompts, generation_config=config)
        cb_seconds = time.perf_counter() - started
        # Request ids are req_<index of the prompt>. Each live request decodes one token a step,
        # and its first token comes from its prefill (as the engine counts: decode forwards only).
        generated = {requests[int(rid.split("_")[1])].record_id: out.generated_tokens for rid, out in batch.items()}
        cb_slots = sum(len(tokens) - 1 for tokens in generated.values())
        differ = [rid for rid, o in outcomes.items()
                  if tokenizer.decode(generated[rid], skip_special_tokens=True).strip() != (o.output or "")]
        same = not differ
        for rid in differ[:2]:
            print(f"  {rid}: the engine wrote {outcomes[rid].output!r}, generate_batch "
                  f"{tokenizer.decode(generated[rid], skip_special_tokens=True).strip()!r}")
        print(f"engine's own loop (refill): {len(outcomes) / own_seconds:.2f} records/s, decode slots "
              f"{counts.decode_rows} ({counts.idle_rows} on finished rows)")
        print(f"generate_batch (paged|sdpa): {len(batch) / cb_seconds:.2f} records/s, decode slots {cb_slots}")
        print(f"same tokens for every record: {'yes' if same else 'NO'}")

        seen: list[Any] = []

        class Grammar(LogitsProcessor):
            """What a per-record schema constraint needs: each row's own tokens so far."""

            def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
                seen.append((tuple(input_ids.shape), tuple(scores.shape)))
                return scores

        try:
            model.generate_batch(inputs=prompts[:4], generation_config=config, logits_processor=[Grammar()])
            print(f"a custom logits processor: called {len(seen)} times, with (input_ids, scores) shapes "
                  f"{sorted(set(seen))[:3]}")
        except Exception as exc:
            print(f"a custom logits processor: refused ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")
    print(f"command: {command}")


if __name__ == "__main__":
    main()
