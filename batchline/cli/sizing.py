"""`batchline capacity` and `batchline simulate`: sizing a job before and after a pilot run."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any, TextIO

from batchline.cli.common import duration
from batchline.errors import BatchlineError
from batchline.sizing import capacity as cap
from batchline.sizing import paced
from batchline.sizing import simulate as sim
from batchline.sizing.pacing import Policy

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_COUNT = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


def count(text: str) -> float:
    """A count as people write it: 50000000, 50,000,000, 5e7, 50M, 8B."""
    match = _COUNT.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (examples: 2000000, 2e6, 2M, 8B)")
    number = float(match.group(1).replace(",", "").replace("_", ""))
    return number * _SUFFIXES.get(match.group(2).lower(), 1.0)


def whole_count(text: str) -> int:
    value = count(text)
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(value)


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be negative")
    return value


def share(text: str) -> float:
    value = non_negative(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is a share: between 0 and 1")
    return value


def size_list(text: str) -> list[int]:
    sizes = [whole_count(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one shard size")
    return sizes


def strategy_list(text: str) -> list[sim.Strategy]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    known = [str(s) for s in sim.Strategy]
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(known)}")
    if not names:
        raise argparse.ArgumentTypeError("give at least one strategy")
    return [sim.Strategy(name) for name in names]


def policy_list(text: str) -> list[Policy]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    known = [str(p) for p in Policy]
    if names == ["all"]:
        return list(Policy)
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(known)} (or all)")
    if not names:
        raise argparse.ArgumentTypeError("give at least one policy")
    return [Policy(name) for name in names]


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _register_capacity(subparsers)
    _register_simulate(subparsers)


# --- capacity ------------------------------------------------------------------------


def _register_capacity(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    gpus = ", ".join(f"{key} ({g.name})" for key, g in cap.GPU_PRESETS.items())
    p = subparsers.add_parser(
        "capacity",
        help="GPUs, hours and cost for a job: a roofline estimate, or a pilot run's throughput",
        description=(
            "Per-GPU throughput of a dense decoder model from a roofline (prefill bound by "
            "FLOP/s, decode by memory bandwidth), and what it makes of a job: GPU-hours, GPUs "
            "to meet the deadline, cost, and a hosted batch API's price for the same tokens. "
            "Defaults are the reference case: Llama 3.1 8B on an H100, 50M records of 1,200 "
            "input (500 shared) and 150 output tokens, 20 hours, $3.50 per GPU-hour."
        ),
    )
    m = p.add_argument_group("model (a preset, or the numbers)")
    m.add_argument("--model", choices=sorted(cap.MODEL_PRESETS), default="llama-3.1-8b")
    m.add_argument("--params", type=count, help="parameters (8e9, 8B)")
    m.add_argument("--layers", type=whole_count)
    m.add_argument("--kv-heads", type=whole_count)
    m.add_argument("--head-dim", type=whole_count)
    m.add_argument("--bytes-per-weight", type=positive, help="2 for BF16, 1 for FP8, 0.5 for 4-bit")
    m.add_argument("--kv-bytes", type=positive, help="bytes per KV cache value (default: as the weights)")
    g = p.add_argument_group("GPU (a preset, or the numbers)")
    g.add_argument("--gpu", choices=sorted(cap.GPU_PRESETS), default="h100-sxm", help=gpus)
    g.add_argument("--tflops", type=positive, help="dense BF16 TFLOP/s")
    g.add_argument("--bandwidth-tbps", type=positive, help="memory bandwidth, TB/s")
    g.add_argument("--memory-gb", type=positive, help="GPU memory, GB")
    e = p.add_argument_group("engine efficiency")
    e.add_argument("--mfu", type=share, default=0.5, help="prefill share of peak FLOP/s (default 0.5)")
    e.add_argument("--decode-efficiency", type=share, default=0.7,
                   help="decode share of peak bandwidth (default 0.7)")
    e.add_argument("--batch", type=whole_count, default=256, help="decode batch (default 256)")
    # None: the reference case's figure, or with --from-run the run's own job.
    w = p.add_argument_group("the job (with --from-run, by default the run's own records and tokens)")
    w.add_argument("--records", type=whole_count, default=None, help="default 50M")
    w.add_argument("--input-tokens", type=positive, default=None,
                   help="per record, prefix included (default 1200)")
    w.add_argument("--output-tokens", type=positive, default=None, help="per record (default 150)")
    w.add_argument("--prefix-tokens", type=non_negative, default=None,
                   help="shared instruction prefix at the start of every input (default 500; 0 with "
                        "--from-run, whose measured rate already reflects any prefix caching)")
    w.add_argument("--deadline-hours", type=positive, default=20.0)
    w.add_argument("--price", type=non_negative, default=3.50,
                   help="USD per GPU-hour (with --from-run, per worker-hour; default 3.50)")
    w.add_argument("--fallback-price", type=non_negative, default=None,
                   help="USD per paid (on-demand) worker-hour of the deadline's fallback (default: three times "
                        "--price)")
    w.add_argument("--interruption-allowance", type=non_negative, default=0.2,
                   help="extra fleet time interruptions cost, as a share of the ideal run "
                        "(`batchline simulate` measures it; default 0.2)")
    a = p.add_argument_group("hosted batch API, for comparison")
    a.add_argument("--api", choices=[*sorted(cap.API_PRESETS), "none"], default="gpt-4o-mini-batch")
    a.add_argument("--api-input-price", type=non_negative, help="USD per million input tokens")
    a.add_argument("--api-output-price", type=non_negative, help="USD per million output tokens")
    p.add_argument("--from-run", metavar="VERSION",
                   help="use the records/s per worker that this job version measured, not the roofline: the "
                        "fleet is then sized in workers like the run's (on the device it names), priced per "
                        "worker-hour")
    p.add_argument("--store", metavar="URL", help="store URL for --from-run (default: $BATCHLINE_STORE or sqlite:///batchline.db)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_capacity)


def measure_run(store_url: str, version: str) -> cap.RunMeasurement:
    """What a run of `version` measured, from the store: records/s per worker (the event
    log), the job's records, and the mean tokens of the results it computed."""
    from batchline.registry import ENGINES
    from batchline.store import open_store, require_job

    store = open_store(store_url, create=False)
    try:
        job = require_job(store, version)
        measured = store.run_throughput(version)
        routes = store.route_totals(version).values()
        runtime = store.pinned_runtime(version)
    finally:
        store.close()
    model = job.spec.get("model", {})
    engine = str(model.get("engine", "unknown"))
    entry = ENGINES.get(engine)
    if not 0 < measured < math.inf:
        raise BatchlineError(f"{version}: the event log has no measured throughput yet")
    computed = sum(t.results for t in routes)
    input_tokens = sum(t.input_tokens for t in routes)
    output_tokens = sum(t.output_tokens for t in routes)
    return cap.RunMeasurement(
        version=version, records_per_second=measured, records=job.record_count,
        engine=engine,
        device=entry.computes_on(model.get("options") or {}, runtime) if entry is not None else None,
        # An engine that reports no token counts leaves them to the command line or the defaults.
        input_tokens=input_tokens / computed if computed and input_tokens else None,
        output_tokens=output_tokens / computed if computed and output_tokens else None)


def build_capacity_report(args: argparse.Namespace) -> cap.CapacityReport:
    base_model = cap.MODEL_PRESETS[args.model]
    model = cap.ModelShape(
        parameters=args.params if args.params is not None else base_model.parameters,
        layers=args.layers or base_model.layers,
        kv_heads=args.kv_heads or base_model.kv_heads,
        head_dim=args.head_dim or base_model.head_dim,
        bytes_per_weight=args.bytes_per_weight or base_model.bytes_per_weight,
        kv_bytes_per_value=args.kv_bytes,
    )
    gpu = cap.GPU_PRESETS[args.gpu]
    if args.tflops or args.bandwidth_tbps or args.memory_gb:
        gpu = replace(
            gpu,
            name=f"{gpu.name}, adjusted",
            bf16_flops=args.tflops * cap.TERA if args.tflops else gpu.bf16_flops,
            memory_bandwidth=args.bandwidth_tbps * cap.TERA if args.bandwidth_tbps else gpu.memory_bandwidth,
            memory_bytes=args.memory_gb * cap.GIGA if args.memory_gb else gpu.memory_bytes,
            source=f"{gpu.source}; overridden on the command line",
        )
    api: cap.HostedApiPrice | None = None if args.api == "none" else cap.API_PRESETS[args.api]
    if args.api_input_price is not None or args.api_output_price is not None:
        if args.api_input_price is None or args.api_output_price is None:
            raise BatchlineError("give both --api-input-price and --api-output-price")
        api = cap.HostedApiPrice(name="hosted batch API", input_per_million=args.api_input_price,
                                 output_per_million=args.api_output_price, source="command line")
    eff = cap.Efficiency(mfu=args.mfu, decode_efficiency=args.decode_efficiency, decode_batch=args.batch)
    run: cap.RunMeasurement | None = None
    if args.from_run:
        from batchline.store import default_url

        run = measure_run(args.store or default_url(), args.from_run)

    def given(value: float | None, from_run: float | None, reference: float) -> float:
        return value if value is not None else from_run if from_run is not None else reference

    work = cap.Workload(
        records=int(given(args.records, run.records if run else None, 50_000_000)),
        input_tokens=given(args.input_tokens, run.input_tokens if run else None, 1200.0),
        output_tokens=given(args.output_tokens, run.output_tokens if run else None, 150.0),
        prefix_tokens=given(args.prefix_tokens, 0.0 if run else None, 500.0),
        deadline_hours=args.deadline_hours, price_per_gpu_hour=args.price,
        interruption_allowance=args.interruption_allowance,
    )
    try:
        return cap.plan_capacity(model, gpu, eff, work, api=api, run=run, paid_price=args.fallback_price)
    except ValueError as exc:
        raise BatchlineError(f"capacity: {exc}") from None


def run_capacity(args: argparse.Namespace) -> int:
    report = build_capacity_report(args)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_capacity(report, sys.stdout)
    return 0


def print_capacity(r: cap.CapacityReport, out: TextIO) -> None:
    m, g, e, w = r.model, r.gpu, r.efficiency, r.workload
    # A measured run's rate is per worker, on whatever that worker had: a CPU, a GPU, a server.
    unit = r.unit
    prefix = f", {w.prefix_tokens:,.0f} of them a shared prefix" if w.prefix_tokens else ""
    lines = [
        f"job     {w.records:,} records of {w.input_tokens:,.0f} input tokens{prefix}, "
        f"and {w.output_tokens:,.0f} output tokens",
        f"        deadline {w.deadline_hours:g} h, ${w.price_per_gpu_hour:,.2f} per {unit}-hour",
    ]
    if r.roofline is not None:
        roof = r.roofline
        lines += [
            f"model   {m.parameters / 1e9:g}B parameters, {m.layers} layers, {m.kv_heads} KV heads "
            f"x {m.head_dim}, {m.bytes_per_weight:g} bytes per weight: {m.weight_bytes / cap.GIGA:.1f} GB "
            f"of weights, {m.kv_bytes_per_token / 1024:g} KiB of KV cache per token",
            f"GPU     {g.name}: {g.bf16_flops / cap.TERA:,.0f} TFLOP/s dense BF16, "
            f"{g.memory_bandwidth / cap.TERA:g} TB/s, {g.memory_bytes / cap.GIGA:g} GB",
            f"        source: {g.source}",
            f"engine  {e.mfu:.0%} MFU in prefill, {e.decode_efficiency:.0%} of bandwidth in decode, "
            f"batch {e.decode_batch}",
            "",
            "per GPU (roofline)",
            f"  prefill   {roof.prefill_tokens_per_second:>10,.0f} tokens/s",
            f"  decode    {roof.decode_tokens_per_second:>10,.0f} tokens/s   "
            f"({roof.decode_bytes_per_step / cap.GIGA:.1f} GB read per step: weights and the "
            f"batch's KV cache at the mean context)",
            f"  memory    {roof.peak_memory_bytes / cap.GIGA:>10.1f} GB at the longest context, of "
            f"{cap.USABLE_MEMORY_SHARE * g.memory_bytes / cap.GIGA:.0f} GB usable",
        ]
        if roof.max_batch_that_fits < e.decode_batch:
            lines.append(
                f"  WARNING: a batch of {e.decode_batch} does not fit; at most "
                f"{roof.max_batch_that_fits} does (0: the weights alone do not fit)"
            )
    elif r.run is not None:
        lines += ["", f"per worker: {r.estimate.records_per_second:,.2f} records/s, measured by run "
                      f"{r.run.version} on the {r.run.engine} engine",
                  f"  device: {r.run.device or 'not known'}; a worker is what that run's workers had, and "
                  "--price is per worker-hour of it"]
        if r.run.engine == "synthetic":
            lines.append("  WARNING: the synthetic engine takes a set time per record; this rate says nothing "
                         "about a model's")
    columns: list[tuple[str, cap.JobEstimate]] = [
        ("measured" if r.roofline is None else "no prefix cache", r.estimate)
    ]
    if r.estimate_prefix_cached is not None:
        columns.append(("prefix cached", r.estimate_prefix_cached))
    allowance = f"{unit}s with a {w.interruption_allowance:.0%} interruption allowance"
    rows: list[tuple[str, Any]] = [
        ("ms per record", lambda j: f"{j.milliseconds_per_record:,.1f}"),
        (f"records/s per {unit}", lambda j: f"{j.records_per_second:,.1f}"),
        (f"{unit}-hours", lambda j: f"{j.gpu_hours:,.0f}"),
        (f"{unit}s running flat out", lambda j: f"{j.gpus_flat_out:,.1f}"),
        (f"whole {unit}s", lambda j: f"{j.gpus_whole:,}"),
        (allowance, lambda j: f"{j.gpus_with_allowance:,}"),
        ("cost", lambda j: f"${j.cost:,.0f}"),
        ("cost with the allowance", lambda j: f"${j.cost_with_allowance:,.0f}"),
    ]
    label_width = max(len(label) for label, _ in rows)
    lines += ["", f"  {'':<{label_width}}" + "".join(f"{name:>18}" for name, _ in columns)]
    for label, fmt in rows:
        lines.append(f"  {label:<{label_width}}" + "".join(f"{fmt(est):>18}" for _, est in columns))
    if r.fallback is not None:
        f = r.fallback
        lines += [
            "",
            f"paid    {f.spot_workers:,} spot {unit}s meet the deadline flat out; to hold it in the worst case the "
            f"{w.interruption_allowance:.0%} allowance admits, a fallback of up to {f.paid_workers:,} paid {unit}s "
            f"(fallback.workers)",
            f"        of the same pinned model: {f.worst_case_paid_hours:,.0f} paid {unit}-hours at "
            f"${f.price_per_paid_hour:,.2f}, ${f.cost:,.0f}, bought only while the job is behind",
        ]
    if r.api is not None and r.api_cost is not None:
        lines += [
            "",
            f"hosted  {r.api.name} at {_usd(r.api.input_per_million)} / {_usd(r.api.output_per_million)} per "
            f"million input / output tokens: ${r.api_cost:,.0f}",
            f"        source: {r.api.source}",
        ]
        if w.deadline_hours < cap.HOSTED_BATCH_WINDOW_HOURS:
            lines.append(f"        not a fallback for this deadline: a hosted batch answers within "
                         f"{cap.HOSTED_BATCH_WINDOW_HOURS:g} h at best, and the deadline is {w.deadline_hours:g} h "
                         "(another model's answers would be another version, too)")
    out.write("\n".join(lines) + "\n")


# --- simulate ------------------------------------------------------------------------


def _default(value: object) -> str:
    """A default as --help states it: a count with thousands separators, a list as it is typed."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)  # as it is typed: no thousands separators
    return str(value)


def _register_simulate(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ref = sim.REFERENCE
    p = subparsers.add_parser(
        "simulate",
        help="simulate a job on preemptible workers: makespan, lost GPU-hours and duplicates "
             "per write strategy and shard size",
        description=(
            "A discrete-event simulation of a job on workers that die (a replacement loads the "
            "model) or stall past their lease (and come back still writing), for three write "
            "strategies and several shard sizes, averaged over seeds. Defaults are the "
            "reference scenario; with --deadline-hours it says which rows meet the deadline."
        ),
    )

    def option(group: Any, flag: str, default: Any, help_text: str, *, unset: str = "", **kwargs: Any) -> None:
        """An option whose help states its default, as every value-taking option here does
        (`unset`: what no value means, for one without a default)."""
        said = f"none: {unset}" if default is None else _default(default)
        group.add_argument(flag, default=default, help=f"{help_text} (default {said})", **kwargs)

    j = p.add_argument_group("the job and the fleet")
    option(j, "--items", ref.items, "records in the job", type=whole_count)
    option(j, "--workers", ref.workers, "workers at once", type=whole_count)
    option(j, "--rate", ref.records_per_second, "items/s per worker", type=positive)
    option(j, "--interruptions-per-hour", ref.interruptions_per_hour, "per worker; exponential gaps",
           type=non_negative)
    option(j, "--stall-share", ref.stall_share, "share of interruptions that are stalls rather than deaths",
           type=share)
    option(j, "--stall-extra-seconds", ref.stall_extra_seconds,
           "mean time a stalled worker stays away beyond its lease", type=non_negative)
    option(j, "--model-load-seconds", ref.model_load_seconds, "what a new or replacement worker spends loading",
           type=positive)
    option(j, "--lease-seconds", ref.lease_seconds, "how long a silent worker's lease holds", type=positive)
    option(j, "--shard-overhead-seconds", ref.shard_overhead_seconds, "per shard: claim, read, complete",
           type=non_negative)
    option(j, "--waves-per-hour", 0.0, "correlated reclaim waves, as when a zone runs short", type=non_negative)
    option(j, "--wave-share", 0.5, "share of workers a wave takes", type=share)
    option(j, "--wave-recovery-seconds", 0.0, "how long a wave's replacements wait for capacity before loading",
           type=non_negative)
    option(j, "--deadline-hours", None, "the job's deadline: say which rows meet it, in how many of their runs",
           unset="no verdict", type=positive, metavar="HOURS")
    s = p.add_argument_group("what to compare")
    option(s, "--shard-sizes", list(sim.REFERENCE_SHARD_SIZES), "comma-separated", type=size_list)
    option(s, "--strategies", list(sim.Strategy), "comma-separated", type=strategy_list)
    option(s, "--seeds", len(sim.REFERENCE_SEEDS), "runs per cell, seeds 0..N-1", type=whole_count)
    s.add_argument("--notice", action="store_true",
                   help="workers get a preemption notice and give their shard back at once (default off)")
    s.add_argument("--tail-split", action="store_true",
                   help="idle workers split the unstarted tail of the last shards off, as the store does "
                        "(default off)")
    s.add_argument("--take-back", action="store_true",
                   help="a dead worker's lease is taken back once it is proven dead, not left to run out "
                        "(default off)")
    s.add_argument("--batchline", action="store_true", help="--notice, --take-back and --tail-split (default off)")
    s.add_argument("--compare", action="store_true",
                   help="every row twice: as the seed design ran it, and as batchline runs it (default off)")
    d = p.add_argument_group("holding a deadline with paid workers (with --policy, instead of the sweep)")
    option(d, "--policy", None, "buy paid workers by these policies, compared over the seeds: none, always, "
           "greedy, uniform (comma-separated), or all", unset="no paid workers, the sweep", type=policy_list)
    option(d, "--fallback-workers", 0, "the most paid workers at once", type=int)
    option(d, "--fallback-cost", 3.0, "price of a paid worker-hour, in spot worker-hours", type=non_negative)
    option(d, "--spot-trace", None, "spot workers available over time: lines of SECONDS WORKERS, or a JSON "
           "availability trace (metadata.gap_seconds, data; one instance's 0 or 1 scaled to --workers)",
           unset="every worker throughout, less --waves", metavar="FILE")
    option(d, "--spot-trace-start", 0.0, "where in --spot-trace the run starts (seconds, or such as 24h)",
           type=duration, metavar="DURATION")
    option(d, "--waves", 0, "reclaim waves within the window, each at a seeded random time", type=int)
    option(d, "--wave-seconds", 3600.0, "how long each of --waves keeps --wave-share of the spot workers away",
           type=positive)
    option(d, "--tick-seconds", 60.0, "how often the pacer decides", type=positive)
    option(d, "--shard-size", 5000, "the shard size of --policy runs", type=whole_count)
    p.add_argument("--recommend-shard-size", action="store_true",
                   help="also pick the shard size with the least expected makespan for keyed-per-record "
                        "(default off)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (default off)")
    option(p, "--plot", None, "draw makespan against shard size per strategy into this file", unset="no plot",
           metavar="PNG")
    p.set_defaults(func=run_simulate)


def _per_hour(value: float, noun: str) -> str:
    return f"{value:g} {noun}" + ("" if value == 1 else "s")


def _usd(value: float) -> str:
    """Prices per million tokens keep their cents and any tenths of a cent ($0.075, $0.30)."""
    return f"${value:,.2f}" if round(value, 2) == value else f"${value:,.3f}"


def _features(scenario: sim.Scenario) -> str:
    on = [name for name, flag in (("notice", scenario.notice), ("take-back", scenario.take_back),
                                  ("tail split", scenario.tail_split)) if flag]
    return " + ".join(on) if on else "none"


def run_simulate(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        base = sim.Scenario(
            items=args.items, workers=args.workers, records_per_second=args.rate,
            interruptions_per_hour=args.interruptions_per_hour, stall_share=args.stall_share,
            stall_extra_seconds=args.stall_extra_seconds, model_load_seconds=args.model_load_seconds,
            lease_seconds=args.lease_seconds, shard_overhead_seconds=args.shard_overhead_seconds,
            waves_per_hour=args.waves_per_hour, wave_share=args.wave_share,
            wave_recovery_seconds=args.wave_recovery_seconds,
            notice=args.notice or args.batchline, tail_split=args.tail_split or args.batchline,
            take_back=args.take_back or args.batchline,
        )
    except ValueError as exc:
        raise BatchlineError(f"simulate: {exc}") from None
    if args.policy is not None:
        return run_policies(args, base, started)
    scenarios = ([replace(base, notice=False, tail_split=False, take_back=False), sim.with_batchline(base)]
                 if args.compare else [base])
    seeds = list(range(args.seeds))
    results: list[tuple[sim.Scenario, list[sim.SweepRow]]] = []
    choice: sim.ShardSizeChoice | None = None
    try:
        for scenario in scenarios:
            results.append((scenario, sim.sweep(scenario, args.strategies, args.shard_sizes, seeds)))
        if args.recommend_shard_size:
            choice = sim.choose_shard_size(scenarios[-1], seeds=args.seeds)
    except sim.SimulationDiverged as exc:
        raise BatchlineError(f"simulate: {exc}") from None
    elapsed = time.perf_counter() - started
    if args.plot:
        plot_sweep(results, args.plot)
    if args.json:
        json.dump(simulate_json(results, choice, seeds, args.deadline_hours), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_simulation(results, choice, seeds, elapsed, sys.stdout, deadline_hours=args.deadline_hours)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def run_policies(args: argparse.Namespace, base: sim.Scenario, started: float) -> int:
    """`simulate --policy`: each policy over the same seeds (the same spot side for all),
    with batchline's worker and store (notices, take-backs, tail splits)."""

    if args.deadline_hours is None:
        raise BatchlineError("simulate --policy needs --deadline-hours: the policies hold a deadline")
    if args.fallback_workers < 0 or args.waves < 0:
        raise BatchlineError("--fallback-workers and --waves cannot be negative")
    if args.fallback_workers == 0 and set(args.policy) - {Policy.NONE}:
        raise BatchlineError("simulate --policy buys paid workers: give --fallback-workers N (at least 1)")
    if args.spot_trace is not None and args.waves:
        raise BatchlineError("--spot-trace and --waves are two ways to say the spot capacity: give one")
    trace = None
    if args.spot_trace is not None:
        trace = paced.Trace.load(args.spot_trace, workers=base.workers, start_seconds=args.spot_trace_start)
    scenario = sim.with_batchline(base)
    deadline = args.deadline_hours * 3600.0
    seeds = list(range(args.seeds))
    policies = list(dict.fromkeys([Policy.NONE, *args.policy]))  # the bound is the spot side's alone
    rows = paced.compare_policies(scenario, deadline, args.fallback_workers, seeds, policies=policies,
                                  shard_size=args.shard_size, paid_price=args.fallback_cost,
                                  tick_seconds=args.tick_seconds, trace=trace, waves=args.waves,
                                  wave_share=args.wave_share, wave_seconds=args.wave_seconds)
    bound = next(r for r in rows if r.policy is Policy.NONE)
    shown = [r for r in rows if r.policy in args.policy]
    elapsed = time.perf_counter() - started
    if args.json:
        json.dump({"scenario": asdict(scenario), "deadline_hours": args.deadline_hours, "seeds": seeds,
                   "fallback_workers": args.fallback_workers, "fallback_cost": args.fallback_cost,
                   "hindsight_bound_hours": bound.bound_hours_mean,
                   "policies": [{**asdict(r), "policy": str(r.policy),
                                 "makespan_hours_mean": r.makespan_hours_mean if math.isfinite(
                                     r.makespan_hours_mean) else None} for r in shown]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print_policies(scenario, args, shown, bound, elapsed, sys.stdout)
    return 0


def print_policies(sc: sim.Scenario, args: argparse.Namespace, rows: Sequence[paced.PolicyRow],
                   bound: paced.PolicyRow, elapsed: float, out: TextIO) -> None:
    spot = (f"spot capacity from {args.spot_trace}" if args.spot_trace else
            f"{args.waves} reclaim waves in the window, each taking {args.wave_share:.0%} of the spot workers for "
            f"{args.wave_seconds / 3600:g} h" if args.waves else "every spot worker throughout")
    lines = [
        f"scenario  {sc.items:,} items on {sc.workers} spot workers at {sc.records_per_second:g} items/s; "
        f"{_per_hour(sc.interruptions_per_hour, 'interruption')} per worker-hour, {sc.stall_share:.0%} of them "
        f"stalls; {spot}",
        f"          model load (the restart overhead d) {sc.model_load_seconds:g} s, lease {sc.lease_seconds:g} s, "
        f"shards of {args.shard_size:,}; ideal {sc.ideal_seconds / 3600:.2f} h; deadline {args.deadline_hours:g} h",
        f"paid      up to {args.fallback_workers} workers at {args.fallback_cost:g}x the spot price; "
        f"{bound.seeds} seeds, a decision every {args.tick_seconds:g} s",
        f"bound     the hindsight lower bound: {bound.bound_hours_mean:.2f} paid worker-hours on average (the work "
        "the spot workers could not do by the deadline, each start's load taken out)",
        "",
        f"{'policy':<10}{'deadlines met':>15}{'paid worker-h':>15}{'paid cost':>11}{'over bound':>12}"
        f"{'makespan h':>12}",
    ]
    for r in rows:
        makespan = f"{r.makespan_hours_mean:.2f}" if math.isfinite(r.makespan_hours_mean) else "never"
        lines.append(f"{r.policy!s:<10}{f'{r.met} of {r.seeds}':>15}{r.paid_hours_mean:>15.2f}"
                     f"{r.paid_cost_mean:>11.2f}{_over(r):>12}{makespan:>12}"
                     + (f"  ({r.unfinished} could not finish)" if r.unfinished else ""))
    lines += ["", "paid cost: in spot worker-hours' prices; over bound: paid worker-hours over the seed's own "
              "hindsight bound, averaged; makespan: over the runs that finished", f"simulated in {elapsed:.1f} s"]
    out.write("\n".join(lines) + "\n")


def _over(row: paced.PolicyRow) -> str:
    return f"{row.over_bound_mean:.2f}x" if row.bound_hours_mean > 0 and row.policy is not Policy.NONE else "-"


def simulate_json(results: Sequence[tuple[sim.Scenario, list[sim.SweepRow]]],
                  choice: sim.ShardSizeChoice | None, seeds: Sequence[int],
                  deadline_hours: float | None = None) -> dict[str, Any]:
    base = results[0][0]
    return {
        "scenario": {k: v for k, v in asdict(base).items() if k not in ("notice", "tail_split", "take_back")},
        "ideal_hours": base.ideal_seconds / 3600.0,
        "seeds": list(seeds),
        # With a deadline, each row's runs_within_deadline: how many of its runs ended by it.
        "deadline_hours": deadline_hours,
        "rows": [
            {"notice": scenario.notice, "tail_split": scenario.tail_split, "take_back": scenario.take_back,
             **row.to_json(),
             **({"runs_within_deadline": row.runs_within(deadline_hours)} if deadline_hours is not None else {})}
            for scenario, rows in results for row in rows
        ],
        "recommendation": None if choice is None else {
            "shard_size": choice.shard_size,
            "strategy": str(choice.strategy),
            "seeds": choice.seeds,
            "tolerance": sim.SHARD_SIZE_TOLERANCE,
            "curve": [{"shard_size": size, "makespan_hours": mean / 3600.0} for size, mean in choice.curve],
        },
    }


def _meets(row: sim.SweepRow, deadline_hours: float) -> str:
    """Whether a row meets the deadline: in every run (yes), in none (no), or in some (k of n)."""
    within = row.runs_within(deadline_hours)
    return "yes" if within == row.seeds else "no" if within == 0 else f"{within} of {row.seeds}"


def deadline_verdict(results: Sequence[tuple[sim.Scenario, list[sim.SweepRow]]], deadline_hours: float) -> str:
    """One line: whether the job meets its deadline, and with what."""
    rows = [(scenario, row) for scenario, rows in results for row in rows]
    fastest_scenario, fastest = min(rows, key=lambda sr: sr[1].makespan_hours)
    best = (f"{fastest.strategy} at shard size {fastest.shard_size:,} (features: {_features(fastest_scenario)})"
            f" takes {fastest.makespan_hours:.2f} h on average")
    always = [row for _scenario, row in rows if row.runs_within(deadline_hours) == row.seeds]
    ideal = results[0][0].ideal_seconds / 3600.0
    if ideal > deadline_hours:
        return (f"deadline {deadline_hours:g} h: MISSED; even the ideal run takes {ideal:.2f} h (more workers, or a "
                f"faster rate, are needed); {best}")
    if always:
        return f"deadline {deadline_hours:g} h: met in every run by {len(always)} of {len(rows)} rows; {best}"
    if fastest.makespan_hours <= deadline_hours:
        return (f"deadline {deadline_hours:g} h: AT RISK; no row meets it in every run; {best}, "
                f"{deadline_hours - fastest.makespan_hours:.2f} h inside it")
    return (f"deadline {deadline_hours:g} h: MISSED by every row; {best}, "
            f"{fastest.makespan_hours - deadline_hours:.2f} h over it")


def print_simulation(results: Sequence[tuple[sim.Scenario, list[sim.SweepRow]]],
                     choice: sim.ShardSizeChoice | None, seeds: Sequence[int], elapsed: float,
                     out: TextIO, *, deadline_hours: float | None = None) -> None:
    sc = results[0][0]
    work_hours = sc.items / (sc.workers * sc.records_per_second) / 3600.0
    waves = (f"; {_per_hour(sc.waves_per_hour, 'reclaim wave')} per hour taking {sc.wave_share:.0%} of workers"
             if sc.waves_per_hour else "")
    lines = [
        f"scenario  {sc.items:,} items on {sc.workers} workers at {sc.records_per_second:g} items/s; "
        f"{_per_hour(sc.interruptions_per_hour, 'interruption')} per worker-hour, {sc.stall_share:.0%} of them "
        f"stalls{waves}",
        f"          model load {sc.model_load_seconds:g} s, lease {sc.lease_seconds:g} s, "
        f"{sc.shard_overhead_seconds:g} s per shard; {len(seeds)} seeds",
        f"ideal     {sc.ideal_seconds / 3600:.2f} h = {work_hours:.2f} h of work + one model load "
        f"({sc.model_load_seconds / 3600:.2f} h)",
        "",
        f"{'features':<33}{'strategy':<18}{'shard size':>11}{'makespan h':>12}{'sd':>6}"
        f"{'over ideal':>12}{'GPU-h lost':>12}{'duplicate rows':>16}"
        + (f"{f'meets {deadline_hours:g} h':>13}" if deadline_hours is not None else ""),
    ]
    for scenario, rows in results:
        for row in rows:
            lines.append(
                f"{_features(scenario):<33}{row.strategy:<18}{row.shard_size:>11,}{row.makespan_hours:>12.2f}"
                f"{row.makespan_hours_stdev:>6.2f}{row.over_ideal:>11.2f}x{row.gpu_hours_lost:>12.1f}"
                f"{row.duplicate_rows:>16,.0f}"
                + (f"{_meets(row, deadline_hours):>13}" if deadline_hours is not None else "")
            )
    if choice is not None:
        chosen = results[-1][0]
        curve = ", ".join(f"{size:,}: {mean / 3600:.2f} h" for size, mean in choice.curve)
        lines += [
            "",
            f"recommended shard size: {choice.shard_size:,} ({choice.strategy}, features: "
            f"{_features(chosen)}; {choice.seeds} seeds; the smallest size within "
            f"{sim.SHARD_SIZE_TOLERANCE:.0%} of the least expected makespan)",
            f"  expected makespan by size: {curve}",
        ]
    if deadline_hours is not None:
        lines += ["", deadline_verdict(results, deadline_hours)]
    lines += ["", f"simulated in {elapsed:.1f} s"]
    out.write("\n".join(lines) + "\n")


def plot_sweep(results: Sequence[tuple[sim.Scenario, list[sim.SweepRow]]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BatchlineError("--plot needs matplotlib: pip install 'batchline[sizing]'") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    # One colour and marker per strategy, one line style per feature set. Append
    # and keyed-per-shard take the same time (they differ in what they write),
    # so append's hollow squares show around keyed-per-shard's dots.
    looks = {
        sim.Strategy.APPEND_PER_SHARD: ("tab:red", "s", 10),
        sim.Strategy.KEYED_PER_SHARD: ("tab:orange", "o", 5),
        sim.Strategy.KEYED_PER_RECORD: ("tab:green", "^", 6),
    }
    sizes: set[int] = set()
    for scenario, rows in results:
        style = "-" if not (scenario.notice or scenario.tail_split or scenario.take_back) else "--"
        for strategy in dict.fromkeys(row.strategy for row in rows):
            points = sorted((r.shard_size, r.makespan_hours) for r in rows if r.strategy == strategy)
            sizes.update(x for x, _ in points)
            colour, marker, marker_size = looks[strategy]
            label = str(strategy) if len(results) == 1 else f"{strategy} ({_features(scenario)})"
            ax.plot([x for x, _ in points], [y for _, y in points], linestyle=style, color=colour,
                    marker=marker, markersize=marker_size,
                    markerfacecolor="none" if strategy is sim.Strategy.APPEND_PER_SHARD else colour,
                    label=label)
    ideal = results[0][0].ideal_seconds / 3600.0
    ax.axhline(ideal, color="grey", linestyle=":", label=f"ideal ({ideal:.2f} h)")
    ax.set_xscale("log")
    ax.set_xticks(sorted(sizes), [f"{x:,}" for x in sorted(sizes)])
    ax.minorticks_off()
    ax.set_xlabel("shard size (items)")
    ax.set_ylabel("makespan (hours)")
    sc = results[0][0]
    ax.set_title(f"{sc.items:,} items, {sc.workers} workers, "
                 f"{_per_hour(sc.interruptions_per_hour, 'interruption')} per worker-hour")
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise BatchlineError(f"--plot: cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)
