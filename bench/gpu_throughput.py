"""Records/s per GPU of the transformers engine on a Llama-3.1-8B-shaped model, against the roofline.

Needs one CUDA GPU with ~100 GB free and nothing from outside the machine:
the weights are random BF16, built on the meta device and materialised on the
GPU, and the tokenizer is a word-level one made here (one token per word), so
each prompt is exactly 1,200 tokens: a 500-token prefix shared by every
record, then 700 tokens of the record's own. Each record decodes exactly 150
tokens (ignore_eos). Decoding is unconstrained: the word-level vocabulary
cannot spell JSON, and llguidance need not be installed.

Each mode is the engine with different options:
  static   prefix_cache false, refill false: the engine before the prefix was
           reused (10.85 records/s at batch 256 on an H200, BENCHMARKS.md)
  prefix   the prefix computed once, static batches
  refill   the prefix computed once, finished rows refilled (the default)

Beside records/s it prints where the time went against the GPU's peaks
(batchline.sizing.capacity's datasheet figures, the H200's unless --gpu says
otherwise): the share of the memory bandwidth decode used (the weights plus
the keys and values of every row's tokens, read once a step) and the share of
the BF16 compute prefill used (2 FLOPs per parameter per prompt token run, as
`batchline capacity` counts them); and the decode slots: rows run in decode
steps, and how many of those were rows whose record had finished.

--spread gives the records very different output lengths (1 to 150 tokens:
prompts of 1,200 to 1,349 tokens on a model that holds 1,350 positions), the
case refill is for; the figures are then not the 1,200 + 150 shape.

    python bench/gpu_throughput.py                        # the measurement, on a GPU
    python bench/gpu_throughput.py --spread --batch-sizes 256
    python bench/gpu_throughput.py --tiny --device cpu    # a smoke run of the script, on the CPU
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchline.engines.base import EngineConfig, EngineRequest, ListRequestSource
from batchline.engines.transformers_engine import TransformersEngine
from batchline.prompts.render import render
from batchline.sizing.capacity import (
    GPU_PRESETS,
    Efficiency,
    GpuSpec,
    ModelShape,
    Workload,
    roofline,
)
from batchline.spec import DecodingSpec, ModelSpec

PREFIX_TOKENS = 500
RECORD_TOKENS = 698  # plus the two record markers: 1,200 prompt tokens
OUTPUT_TOKENS = 150
MODES = {
    "static": {"prefix_cache": False, "refill": False},
    "prefix": {"prefix_cache": True, "refill": False},
    "refill": {"prefix_cache": True, "refill": True},
}


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


def requests(n: int, vocab: int, seed: int, spread: bool) -> list[EngineRequest]:
    rng = random.Random(seed)
    prefix = " ".join(f"w{rng.randrange(4, vocab)}" for _ in range(PREFIX_TOKENS)) + "\n"
    out = []
    for i in range(n):
        # Spread: 0 to 149 more tokens, so the model's position limit leaves 150 to 1 to decode.
        length = RECORD_TOKENS + (i * 37 % OUTPUT_TOKENS if spread else 0)
        text = " ".join(f"w{rng.randrange(4, vocab)}" for _ in range(length))
        out.append(EngineRequest(record_id=f"r{i}", prompt=render(prefix, "", text), prefix=prefix, text=text))
    return out


@dataclass
class Phases:
    """Time and work of the engine's forwards, split into prefill and decode."""

    prefill_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt tokens run (not padding, not reused)
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_kv_tokens: int = 0  # keys and values of real tokens read, summed over steps


def timed(engine: TransformersEngine, phases: Phases) -> None:
    """Wraps the engine's model calls to time each one to its end on the device.

    The engine reads each step's chosen tokens on the host anyway, so waiting
    for the device after a call costs little that the engine did not already pay.
    """
    import torch

    forward = engine.forward
    cuda = engine.device.type == "cuda"

    def measured(input_ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = forward(input_ids, mask, positions, cache)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        width = input_ids.shape[1]
        if width == 1:
            phases.decode_seconds += elapsed
            phases.decode_steps += 1
            phases.decode_kv_tokens += int(mask.sum())
        else:
            phases.prefill_seconds += elapsed
            phases.prefill_tokens += int(mask[:, -width:].sum())
        return result

    engine.forward = measured  # type: ignore[method-assign]


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


def shape_of(model: Any) -> ModelShape:
    config = model.config
    return ModelShape(
        parameters=float(sum(p.numel() for p in model.parameters())),
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        bytes_per_weight=next(model.parameters()).element_size(),
    )


def roofline_line(shape: ModelShape, gpu: GpuSpec, batch: int) -> str:
    work = Workload(records=1, input_tokens=PREFIX_TOKENS + RECORD_TOKENS + 2, output_tokens=OUTPUT_TOKENS,
                    prefix_tokens=PREFIX_TOKENS)
    peak = roofline(shape, gpu, Efficiency(mfu=1.0, decode_efficiency=1.0, decode_batch=batch), work)
    usual = roofline(shape, gpu, Efficiency(decode_batch=batch), work)
    return (f"roofline, {gpu.name}, batch {batch}: {1 / peak.seconds_per_record:.1f} records/s at its peaks "
            f"({1 / peak.seconds_per_record_prefix_cached:.1f} with the prefix computed once); "
            f"{1 / usual.seconds_per_record:.1f} ({1 / usual.seconds_per_record_prefix_cached:.1f}) at "
            f"batchline capacity's MFU 0.5 and 70% of the bandwidth")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small model, to test the script")
    parser.add_argument("--batch-sizes", default="64,128,256")
    parser.add_argument("--modes", default="static,prefix,refill", help=f"of {', '.join(MODES)}")
    parser.add_argument("--batches", type=int, default=1, help="batches' worth of records per run")
    parser.add_argument("--spread", action="store_true", help="output lengths from 1 to 150 tokens")
    parser.add_argument("--gpu", default="h200", choices=sorted(GPU_PRESETS),
                        help="whose peaks the shares are of")
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible; use --tiny --device cpu for a smoke run")
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    command = "python bench/gpu_throughput.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.perf_counter()
    model, tokenizer = build(args.tiny, args.device)
    if args.spread:
        model.config.max_position_embeddings = PREFIX_TOKENS + RECORD_TOKENS + 2 + OUTPUT_TOKENS
    gpu = GPU_PRESETS[args.gpu]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    shape = shape_of(model)
    print(f"model: {'tiny Llama' if args.tiny else 'Llama-3.1-8B shape'} ({shape.parameters / 1e6:,.1f}M params, "
          f"random {next(model.parameters()).dtype}) on {device_name}; built in "
          f"{time.perf_counter() - started:.1f}s; torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}", flush=True)
    print(f"decoding: greedy, unconstrained (no grammar), "
          f"{'outputs of 1 to 150 tokens (--spread)' if args.spread else 'exactly 150 output tokens a record'}")
    if args.device != "cuda":
        print(f"shares below are of the {gpu.name}'s peaks: on the CPU they only show the script works")
    vocab = model.config.vocab_size
    results = []
    for mode in modes:
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            config = EngineConfig(
                model=ModelSpec(engine="transformers", options={
                    "constrained": False, "ignore_eos": True, "batch_size": batch_size, **MODES[mode]}),
                decoding=DecodingSpec(temperature=0.0, max_tokens=OUTPUT_TOKENS, seed=0),
                output_schema={},
            )
            engine = TransformersEngine(config)
            engine.attach(model, tokenizer)
            try:
                run(engine, requests(min(batch_size, 8), vocab, seed=1, spread=args.spread))  # warm-up
                engine.counts = type(engine.counts)()
                phases = Phases()
                timed(engine, phases)
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                n = batch_size * args.batches
                elapsed, tokens_in, tokens_out = run(engine, requests(n, vocab, seed=2, spread=args.spread))
            except torch.cuda.OutOfMemoryError:
                print(f"{mode} batch {batch_size}: out of GPU memory", flush=True)
                torch.cuda.empty_cache()
                continue
            finally:
                engine.close()
            peak_memory = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
            counts = engine.counts
            bandwidth = (phases.decode_steps * shape.weight_bytes + phases.decode_kv_tokens * shape.kv_bytes_per_token) / (
                max(phases.decode_seconds, 1e-9) * gpu.memory_bandwidth)
            compute = 2 * shape.parameters * phases.prefill_tokens / (max(phases.prefill_seconds, 1e-9) * gpu.bf16_flops)
            print(f"{mode:6s} batch {batch_size:4d}: {n} records in {elapsed:6.1f}s = {n / elapsed:7.2f} records/s, "
                  f"{tokens_out / elapsed:7.0f} output tok/s, {tokens_in // n} prompt + {tokens_out / n:.0f} output "
                  f"tokens a record, peak {peak_memory:.0f} GiB", flush=True)
            print(f"{'':6s}   decode {phases.decode_seconds:6.1f}s, {phases.decode_steps} steps, "
                  f"{bandwidth:6.1%} of {gpu.memory_bandwidth / 1e12:.2f} TB/s; "
                  f"prefill {phases.prefill_seconds:6.1f}s, {compute:6.1%} of {gpu.bf16_flops / 1e12:.0f} TFLOP/s; "
                  f"other {max(0.0, elapsed - phases.decode_seconds - phases.prefill_seconds):5.1f}s", flush=True)
            print(f"{'':6s}   decode slots {counts.decode_rows}, {counts.idle_rows} of them on finished rows; "
                  f"prompt tokens run {counts.prefill_tokens}, reused from the prefix {counts.reused_tokens}, "
                  f"padding {counts.prefill_padding}", flush=True)
            results.append((n / elapsed, mode, batch_size))
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if results:
        best, mode, batch_size = max(results)
        print(f"best: {best:.2f} records/s per GPU ({mode}, batch {batch_size}, transformers engine, "
              f"{next(model.parameters()).dtype}, {model.config._attn_implementation} attention)")
        print(roofline_line(shape, gpu, batch_size))
    print(f"command: {command}   (total {time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
