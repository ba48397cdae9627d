"""Sizing arithmetic: how many GPUs, for how long, at what cost.

A roofline estimate for a dense decoder-only model on one GPU:

- Prefill is compute-bound: a forward pass costs about 2 FLOPs per parameter per
  token, so prefill tokens/s = MFU x peak dense FLOP/s / (2 x parameters).
- Decode is memory-bound: every step of a batch of B sequences streams all the
  weights once plus each sequence's KV cache, so decode tokens/s =
  B x efficiency x bandwidth / (weight bytes + B x mean context x KV bytes per token).
  The mean context over a record's decode is its input plus half its output.
- A shared instruction prefix, when the engine caches it, is prefilled once per
  GPU rather than once per record, so only the input after the prefix costs
  prefill time. Its KV is still read on every decode step, so decode is unchanged.

Attention FLOPs during prefill are left out: at a few thousand tokens of context
they are a few percent of the 2-FLOPs-per-parameter term for models of 7B and up,
well inside the uncertainty of the MFU guess.

Measured throughput (``records_per_second`` from a pilot run) replaces the
roofline entirely: everything downstream of records/s per GPU is the same.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

# Bytes in the units people quote for GPUs: decimal, as the datasheets use.
TERA = 1e12
GIGA = 1e9

# Share of GPU memory that weights and KV cache may fill; the rest is
# activations, the CUDA context and allocator slack. vLLM's default
# gpu_memory_utilization is 0.9 for the same reason.
USABLE_MEMORY_SHARE = 0.9


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's peak figures, as its vendor's datasheet states them."""

    name: str
    bf16_flops: float  # dense (no 2:4 sparsity) BF16 tensor-core FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    source: str


# Datasheet figures. NVIDIA quotes BF16 "with sparsity"; the dense figure is half
# of it, and dense is what a transformer's matmuls get.
GPU_PRESETS: dict[str, GpuSpec] = {
    "h100-sxm": GpuSpec(
        name="NVIDIA H100 SXM 80GB",
        bf16_flops=989 * TERA,
        memory_bandwidth=3.35 * TERA,
        memory_bytes=80 * GIGA,
        source="NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity, "
        "HBM3 3.35 TB/s, 80 GB",
    ),
    "h200": GpuSpec(
        name="NVIDIA H200 SXM 141GB",
        bf16_flops=989 * TERA,
        memory_bandwidth=4.8 * TERA,
        memory_bytes=141 * GIGA,
        source="NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity, "
        "HBM3e 4.8 TB/s, 141 GB",
    ),
    "a100-80gb": GpuSpec(
        name="NVIDIA A100 SXM 80GB",
        bf16_flops=312 * TERA,
        memory_bandwidth=2.039 * TERA,
        memory_bytes=80 * GIGA,
        source="NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense, "
        "HBM2e 2,039 GB/s (SXM 80GB), 80 GB",
    ),
    "l4": GpuSpec(
        name="NVIDIA L4 24GB",
        bf16_flops=121 * TERA,
        memory_bandwidth=300 * GIGA,
        memory_bytes=24 * GIGA,
        source="NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity, "
        "GDDR6 300 GB/s, 24 GB",
    ),
}


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs to know about a dense decoder-only model."""

    parameters: float
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_weight: float = 2.0
    # KV cache precision; None means the same as the weights (BF16 KV with BF16
    # weights, as vLLM does unless told otherwise).
    kv_bytes_per_value: float | None = None

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_weight

    @property
    def kv_bytes_per_token(self) -> float:
        per_value = self.bytes_per_weight if self.kv_bytes_per_value is None else self.kv_bytes_per_value
        # A key and a value per layer per KV head.
        return 2 * self.layers * self.kv_heads * self.head_dim * per_value


MODEL_PRESETS: dict[str, ModelShape] = {
    # Llama 3.1 model card / config.json: 32 layers, 8 KV heads (GQA), head dim 128.
    "llama-3.1-8b": ModelShape(parameters=8e9, layers=32, kv_heads=8, head_dim=128),
    # Llama 3.1 70B config.json: 80 layers, 8 KV heads, head dim 128, 70.6B parameters.
    "llama-3.1-70b": ModelShape(parameters=70.6e9, layers=80, kv_heads=8, head_dim=128),
}


@dataclass(frozen=True)
class Efficiency:
    """How close to the GPU's peaks the engine gets."""

    mfu: float = 0.5  # prefill: share of peak FLOP/s
    decode_efficiency: float = 0.7  # decode: share of peak memory bandwidth
    decode_batch: int = 256  # sequences decoded together


@dataclass(frozen=True)
class Workload:
    records: int
    input_tokens: float  # per record, including the shared prefix
    output_tokens: float  # per record
    prefix_tokens: float = 0.0  # shared instruction prefix at the start of every input
    deadline_hours: float = 20.0
    price_per_gpu_hour: float = 3.50
    # Extra fleet time that interruptions cost, as a share of the ideal run
    # (makespan over ideal, minus one). `batchline simulate` measures it for a
    # given interruption rate and shard size.
    interruption_allowance: float = 0.2


@dataclass(frozen=True)
class HostedApiPrice:
    name: str
    input_per_million: float  # USD per million input tokens
    output_per_million: float  # USD per million output tokens
    source: str


API_PRESETS: dict[str, HostedApiPrice] = {
    "gpt-4o-mini-batch": HostedApiPrice(
        name="OpenAI Batch API, gpt-4o-mini",
        input_per_million=0.075,
        output_per_million=0.30,
        source="OpenAI API pricing page (2024): gpt-4o-mini $0.15 / $0.60 per million "
        "input / output tokens, Batch API at half price; check current prices",
    ),
}


@dataclass(frozen=True)
class Roofline:
    """Per-GPU throughput from the roofline, for one record shape."""

    prefill_tokens_per_second: float
    decode_tokens_per_second: float
    decode_bytes_per_step: float
    peak_memory_bytes: float  # weights + KV of a full batch at the longest context
    max_batch_that_fits: int
    seconds_per_record: float
    seconds_per_record_prefix_cached: float

    @property
    def fits(self) -> bool:
        return self.max_batch_that_fits > 0


@dataclass(frozen=True)
class JobEstimate:
    """What a job costs at a given per-GPU throughput."""

    records_per_second: float  # per GPU
    gpu_hours: float
    gpus_flat_out: float  # GPUs that would just meet the deadline with no interruption
    gpus_whole: int
    gpus_with_allowance: int
    cost: float  # GPU-hours of work times the price
    cost_with_allowance: float  # the same, plus the GPU time interruptions cost

    @property
    def milliseconds_per_record(self) -> float:
        return 1000.0 / self.records_per_second


# A hosted batch API answers within this window at best (OpenAI's; batches have been
# measured at 8, 19 and 24.5 hours): not a fallback for a shorter deadline.
HOSTED_BATCH_WINDOW_HOURS = 24.0


@dataclass(frozen=True)
class PaidFallback:
    """A spot fleet sized to the deadline without an allowance, and the paid workers of the
    same pinned model that hold the deadline in the worst case the allowance admits (its
    interruptions cost the whole allowance)."""

    spot_workers: int  # the whole workers that just meet the deadline flat out
    paid_workers: int  # the most paid workers at once: the allowance's share of the fleet
    worst_case_paid_hours: float  # the work the interruptions took, done again on paid workers
    price_per_paid_hour: float
    cost: float  # of those paid hours


def paid_fallback(estimate: JobEstimate, work: Workload, price_per_paid_hour: float) -> PaidFallback:
    paid = max(0, estimate.gpus_with_allowance - estimate.gpus_whole)
    if work.interruption_allowance > 0:
        paid = max(paid, 1)
    hours = estimate.gpu_hours * work.interruption_allowance
    return PaidFallback(estimate.gpus_whole, paid, hours, price_per_paid_hour, hours * price_per_paid_hour)


@dataclass(frozen=True)
class RunMeasurement:
    """What a run of a job version measured: its throughput per worker, and its job."""

    version: str
    records_per_second: float
    records: int
    engine: str  # a synthetic engine's rate is a stand-in's, not a model's
    input_tokens: float | None  # mean per computed result; None when the engine reported none
    output_tokens: float | None
    # What its workers computed on, in words ("the CPU", "a GPU"); None: not known. A rate
    # measured per worker sizes a fleet of such workers, not of GPUs.
    device: str | None = None


@dataclass(frozen=True)
class CapacityReport:
    model: ModelShape
    gpu: GpuSpec
    efficiency: Efficiency
    workload: Workload
    roofline: Roofline | None  # None when throughput was measured
    run: RunMeasurement | None  # the run a measured throughput came from
    estimate: JobEstimate
    estimate_prefix_cached: JobEstimate | None
    api: HostedApiPrice | None
    api_cost: float | None
    fallback: PaidFallback | None = None

    @property
    def unit(self) -> str:
        """What the estimate counts: a roofline's GPUs, or the workers a run measured."""
        return "GPU" if self.run is None else "worker"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = asdict(self)
        out["measured_from"] = self.run.version if self.run is not None else None  # as before `run` was added
        # What the estimate's gpu_* figures count: GPUs for a roofline, workers for a measured run.
        out["unit"] = self.unit
        out["model"]["weight_bytes"] = self.model.weight_bytes
        out["model"]["kv_bytes_per_token"] = self.model.kv_bytes_per_token
        for key, est in (("estimate", self.estimate), ("estimate_prefix_cached", self.estimate_prefix_cached)):
            if est is not None:
                out[key]["milliseconds_per_record"] = est.milliseconds_per_record
        if self.roofline is not None:
            out["roofline"]["fits"] = self.roofline.fits
        return out


def prefill_tokens_per_second(model: ModelShape, gpu: GpuSpec, eff: Efficiency) -> float:
    return eff.mfu * gpu.bf16_flops / (2.0 * model.parameters)


def decode_bytes_per_step(model: ModelShape, eff: Efficiency, work: Workload) -> float:
    mean_context = work.input_tokens + work.output_tokens / 2.0
    return model.weight_bytes + eff.decode_batch * mean_context * model.kv_bytes_per_token


def decode_tokens_per_second(model: ModelShape, gpu: GpuSpec, eff: Efficiency, work: Workload) -> float:
    step_seconds = decode_bytes_per_step(model, eff, work) / (eff.decode_efficiency * gpu.memory_bandwidth)
    return eff.decode_batch / step_seconds


def roofline(model: ModelShape, gpu: GpuSpec, eff: Efficiency, work: Workload) -> Roofline:
    _check_positive(
        parameters=model.parameters, layers=model.layers, kv_heads=model.kv_heads,
        head_dim=model.head_dim, bytes_per_weight=model.bytes_per_weight,
        flops=gpu.bf16_flops, bandwidth=gpu.memory_bandwidth, mfu=eff.mfu,
        decode_efficiency=eff.decode_efficiency, decode_batch=eff.decode_batch,
        output_tokens=work.output_tokens,
    )
    if not 0 <= work.prefix_tokens <= work.input_tokens:
        raise ValueError("prefix tokens must be between 0 and the input tokens")
    prefill = prefill_tokens_per_second(model, gpu, eff)
    decode = decode_tokens_per_second(model, gpu, eff, work)
    decode_seconds = work.output_tokens / decode
    longest = work.input_tokens + work.output_tokens
    usable = USABLE_MEMORY_SHARE * gpu.memory_bytes
    max_batch = math.floor((usable - model.weight_bytes) / (longest * model.kv_bytes_per_token))
    return Roofline(
        prefill_tokens_per_second=prefill,
        decode_tokens_per_second=decode,
        decode_bytes_per_step=decode_bytes_per_step(model, eff, work),
        peak_memory_bytes=model.weight_bytes + eff.decode_batch * longest * model.kv_bytes_per_token,
        max_batch_that_fits=max(0, max_batch),
        seconds_per_record=work.input_tokens / prefill + decode_seconds,
        seconds_per_record_prefix_cached=(work.input_tokens - work.prefix_tokens) / prefill + decode_seconds,
    )


def job_estimate(records_per_second: float, work: Workload) -> JobEstimate:
    _check_positive(records_per_second=records_per_second, records=work.records,
                    deadline_hours=work.deadline_hours)
    if work.interruption_allowance < 0:
        raise ValueError("the interruption allowance cannot be negative")
    gpu_hours = work.records / records_per_second / 3600.0
    flat_out = gpu_hours / work.deadline_hours
    # Round before ceil so that 38.0000000001 from float noise is 38 GPUs, not 39.
    def whole(x: float) -> int:
        return math.ceil(round(x, 9))

    return JobEstimate(
        records_per_second=records_per_second,
        gpu_hours=gpu_hours,
        gpus_flat_out=flat_out,
        gpus_whole=whole(flat_out),
        gpus_with_allowance=whole(flat_out * (1.0 + work.interruption_allowance)),
        cost=gpu_hours * work.price_per_gpu_hour,
        cost_with_allowance=gpu_hours * (1.0 + work.interruption_allowance) * work.price_per_gpu_hour,
    )


def hosted_api_cost(work: Workload, api: HostedApiPrice) -> float:
    return work.records * (
        work.input_tokens * api.input_per_million + work.output_tokens * api.output_per_million
    ) / 1e6


def plan_capacity(
    model: ModelShape,
    gpu: GpuSpec,
    eff: Efficiency,
    work: Workload,
    *,
    api: HostedApiPrice | None = None,
    run: RunMeasurement | None = None,
    paid_price: float | None = None,
) -> CapacityReport:
    """The whole sizing table; a run's measured throughput replaces the roofline."""
    if run is not None:
        roof = None
        estimate = job_estimate(run.records_per_second, work)
        cached = None  # a measured run already reflects whatever caching it had
    else:
        roof = roofline(model, gpu, eff, work)
        estimate = job_estimate(1.0 / roof.seconds_per_record, work)
        cached = (
            job_estimate(1.0 / roof.seconds_per_record_prefix_cached, work)
            if work.prefix_tokens > 0 else None
        )
    return CapacityReport(
        model=model, gpu=gpu, efficiency=eff, workload=work, roofline=roof,
        run=run, estimate=estimate, estimate_prefix_cached=cached,
        api=api, api_cost=hosted_api_cost(work, api) if api is not None else None,
        fallback=paid_fallback(estimate, work, paid_price if paid_price is not None else 3 * work.price_per_gpu_hour),
    )


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:  # also rejects NaN
            raise ValueError(f"{name.replace('_', ' ')} must be positive, not {value}")
