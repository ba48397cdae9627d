"""Records/s per GPU of the transformers engine on a Llama-3.1-8B-shaped model.

Needs one CUDA GPU with ~100 GB free and nothing from outside the machine:
the weights are random BF16, built on the meta device and materialised on the
GPU, and the tokenizer is a word-level one made here (one token per word), so
each prompt is exactly 1,200 tokens: a 500-token prefix shared by every
record, then 700 tokens of the record's own. Each record decodes exactly 150
tokens (ignore_eos). Finishes in a few minutes.

    python bench/gpu_throughput.py                    # the measurement, on a GPU
    python bench/gpu_throughput.py --tiny --device cpu  # a smoke run of the script itself

Static batching is a lower bound for what vLLM would do with the same model:
vLLM's continuous batching refills finished rows at once and its automatic
prefix caching computes the shared 500-token prefix once instead of per record.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchline.engines.base import EngineConfig, EngineRequest, ListRequestSource
from batchline.engines.transformers_engine import TransformersEngine
from batchline.prompt import render
from batchline.spec import DecodingSpec, ModelSpec

PREFIX_TOKENS = 500
RECORD_TOKENS = 698  # plus the two record markers: 1,200 prompt tokens
OUTPUT_TOKENS = 150



def build(tiny: bool, device: str) -> tuple[Any, Any]:
    import tokenizers
    import torch
    import transformers as transformers_module

    # The library's stubs lag its API (rope settings, tokenizer classes): used untyped here.
    transformers: Any = transformers_module
    if tiny:
        config = transformers.LlamaConfig(
            vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        )
    else:  # Llama 3.1 8B's shape
        config = transformers.LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        )
    words = {"<s>": 0, "</s>": 1, "<pad>": 2, "[UNK]": 3}
    words.update({f"w{i}": i for i in range(4, config.vocab_size)})
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="[UNK]",
    )
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, 2

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        model: Any = transformers.LlamaForCausalLM(config)
    # Cast while still on meta (free), so the GPU never holds a float32 copy.
    model = model.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
        # Buffers computed at construction (the rotary frequencies) were left empty by to_empty.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)
    return model, tokenizer


def requests(n: int, vocab: int, seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    prefix = " ".join(f"w{rng.randrange(4, vocab)}" for _ in range(PREFIX_TOKENS)) + "\n"
    out = []
    for i in range(n):
        text = " ".join(f"w{rng.randrange(4, vocab)}" for _ in range(RECORD_TOKENS))
        out.append(EngineRequest(record_id=f"r{i}", prompt=render(prefix, "", text), prefix=prefix, text=text))
    return out


def run(engine: TransformersEngine, reqs: list[EngineRequest]) -> tuple[float, int, int]:
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    outcomes = list(engine.generate(ListRequestSource(reqs)))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    errors = [o.error for o in outcomes if o.error]
    if errors:
        raise SystemExit(f"{len(errors)} records failed, first: {errors[0]}")
    return elapsed, sum(o.input_tokens or 0 for o in outcomes), sum(o.output_tokens or 0 for o in outcomes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small model, to test the script")
    parser.add_argument("--batch-sizes", default="64,128,256")
    parser.add_argument("--batches", type=int, default=1, help="timed batches per batch size")
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible; use --tiny --device cpu for a smoke run")
    command = "python bench/gpu_throughput.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.perf_counter()
    model, tokenizer = build(args.tiny, args.device)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    shape = "tiny Llama" if args.tiny else "Llama-3.1-8B shape"
    print(f"model: {shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, "
          f"random {next(model.parameters()).dtype}) on {gpu}; built in {time.perf_counter() - started:.1f}s",
          flush=True)
    vocab = model.config.vocab_size
    results = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        config = EngineConfig(
            model=ModelSpec(engine="transformers", options={
                "constrained": False, "ignore_eos": True, "batch_size": batch_size}),
            decoding=DecodingSpec(temperature=0.0, max_tokens=OUTPUT_TOKENS, seed=0),
            output_schema={},
        )
        engine = TransformersEngine(config)
        engine.attach(model, tokenizer)
        try:
            run(engine, requests(min(batch_size, 8), vocab, seed=1))  # warm-up: kernels, allocator
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            elapsed, tokens_in, tokens_out = run(engine, requests(batch_size * args.batches, vocab, seed=2))
        except torch.cuda.OutOfMemoryError:
            print(f"batch {batch_size}: out of GPU memory", flush=True)
            torch.cuda.empty_cache()
            continue
        n = batch_size * args.batches
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
        line = (f"batch {batch_size:4d}: {n} records in {elapsed:6.1f}s = {n / elapsed:7.2f} records/s per GPU, "
                f"{tokens_out / elapsed:8.0f} output tok/s, {tokens_in / elapsed:9.0f} prompt tok/s, "
                f"{tokens_in // n} prompt + {tokens_out // n} output tokens per record, peak {peak:.0f} GiB")
        results.append((n / elapsed, batch_size))
        print(line, flush=True)
        torch.cuda.empty_cache() if args.device == "cuda" else None
    if results:
        best, batch_size = max(results)
        print(f"best: {best:.2f} records/s per GPU (static batches of {batch_size}, transformers engine, "
              f"{next(model.parameters()).dtype}, {model.config._attn_implementation} attention)")
    print("static batching is a lower bound for vLLM on the same model: vLLM refills finished rows at "
          "once (continuous batching) and computes the shared 500-token prefix once (prefix caching), "
          "where this engine recomputes it for every record")
    print(f"command: {command}   (total {time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
