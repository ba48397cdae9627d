"""The sizing arithmetic, pinned to the reference case: Llama 3.1 8B on an H100."""

from __future__ import annotations

import math

import pytest

from batchline.sizing import capacity as cap

LLAMA_8B = cap.ModelShape(parameters=8e9, layers=32, kv_heads=8, head_dim=128, bytes_per_weight=2)
H100 = cap.GpuSpec(name="H100", bf16_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80e9, source="test")
EFF = cap.Efficiency(mfu=0.5, decode_efficiency=0.7, decode_batch=256)
JOB = cap.Workload(records=50_000_000, input_tokens=1200, output_tokens=150, prefix_tokens=500,
                   deadline_hours=20, price_per_gpu_hour=3.50)


@pytest.fixture
def report() -> cap.CapacityReport:
    return cap.plan_capacity(LLAMA_8B, H100, EFF, JOB)


def test_reference_roofline(report: cap.CapacityReport) -> None:
    roof = report.roofline
    assert roof is not None
    assert round(roof.prefill_tokens_per_second, -2) == 30_900
    assert round(roof.decode_tokens_per_second, -2) == 10_200
    assert round(roof.decode_bytes_per_step / 1e9, 1) == 58.8


def test_reference_job_without_prefix_cache(report: cap.CapacityReport) -> None:
    est = report.estimate
    assert round(est.milliseconds_per_record, 1) == 53.5
    assert round(est.records_per_second, 1) == 18.7
    assert round(est.gpu_hours) == 743
    assert round(est.gpus_flat_out, 1) == 37.2
    assert est.gpus_whole == 38
    assert round(est.cost, -2) == 2_600


def test_reference_job_with_prefix_cached(report: cap.CapacityReport) -> None:
    est = report.estimate_prefix_cached
    assert est is not None
    assert round(est.milliseconds_per_record, 1) == 37.3
    assert round(est.records_per_second, 1) == 26.8
    # Caching the prefix saves prefill only: decode time per record is the same.
    assert est.gpu_hours < report.estimate.gpu_hours


def test_the_reference_presets_reproduce_the_reference_case() -> None:
    preset = cap.plan_capacity(cap.MODEL_PRESETS["llama-3.1-8b"], cap.GPU_PRESETS["h100-sxm"], EFF, JOB)
    assert preset.estimate == cap.plan_capacity(LLAMA_8B, H100, EFF, JOB).estimate


def test_kv_cache_bytes_per_token() -> None:
    # 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB.
    assert LLAMA_8B.kv_bytes_per_token == 131_072
    fp8_kv = cap.ModelShape(parameters=8e9, layers=32, kv_heads=8, head_dim=128, kv_bytes_per_value=1)
    assert fp8_kv.kv_bytes_per_token == 65_536


def test_interruption_allowance_adds_gpus_and_cost() -> None:
    none = cap.job_estimate(18.686, cap.Workload(records=50_000_000, input_tokens=1, output_tokens=1,
                                                 interruption_allowance=0.0))
    some = cap.job_estimate(18.686, cap.Workload(records=50_000_000, input_tokens=1, output_tokens=1,
                                                 interruption_allowance=0.2))
    assert none.gpus_with_allowance == none.gpus_whole == 38
    assert some.gpus_with_allowance == math.ceil(37.16 * 1.2) == 45
    assert some.cost_with_allowance == pytest.approx(none.cost * 1.2)


def test_whole_gpus_do_not_round_up_float_noise() -> None:
    # 2,736,000 records at 1/s is 760 GPU-hours: exactly 38 GPUs over 20 hours.
    work = cap.Workload(records=2_736_000, input_tokens=1, output_tokens=1, deadline_hours=20,
                        interruption_allowance=0.0)
    assert cap.job_estimate(1.0, work).gpus_whole == 38
    assert cap.job_estimate(0.9999, work).gpus_whole == 39


def test_measured_throughput_replaces_the_roofline() -> None:
    run = cap.RunMeasurement("job@abc", records_per_second=10.0, records=50_000_000, engine="llamacpp",
                             input_tokens=1200.0, output_tokens=150.0)
    r = cap.plan_capacity(LLAMA_8B, H100, EFF, JOB, run=run)
    assert r.roofline is None
    assert r.estimate_prefix_cached is None
    assert r.estimate.gpu_hours == pytest.approx(50_000_000 / 10.0 / 3600)
    assert r.to_json()["measured_from"] == "job@abc"


def test_hosted_api_cost() -> None:
    api = cap.API_PRESETS["gpt-4o-mini-batch"]
    # 60,000M input tokens at $0.075 plus 7,500M output tokens at $0.30.
    assert cap.hosted_api_cost(JOB, api) == pytest.approx(4_500 + 2_250)
    assert cap.plan_capacity(LLAMA_8B, H100, EFF, JOB, api=api).api_cost == pytest.approx(6_750)


def test_memory_check_flags_a_batch_that_does_not_fit() -> None:
    l4 = cap.plan_capacity(LLAMA_8B, cap.GPU_PRESETS["l4"], EFF, JOB).roofline
    assert l4 is not None
    assert 0 < l4.max_batch_that_fits < EFF.decode_batch
    # 70B in BF16 is 141 GB of weights: it does not fit on one 80 GB GPU at all.
    big = cap.plan_capacity(cap.MODEL_PRESETS["llama-3.1-70b"], H100, EFF, JOB).roofline
    assert big is not None
    assert big.max_batch_that_fits == 0
    assert not big.fits
    h100 = cap.plan_capacity(LLAMA_8B, H100, EFF, JOB).roofline
    assert h100 is not None
    assert h100.max_batch_that_fits >= EFF.decode_batch


def test_gpu_presets_cite_their_sources() -> None:
    assert set(cap.GPU_PRESETS) == {"h100-sxm", "h200", "a100-80gb", "l4"}
    for gpu in cap.GPU_PRESETS.values():
        assert "datasheet" in gpu.source
    # The H200 is an H100 with faster, larger memory: same compute, faster decode.
    assert cap.GPU_PRESETS["h200"].bf16_flops == cap.GPU_PRESETS["h100-sxm"].bf16_flops
    h200 = cap.plan_capacity(LLAMA_8B, cap.GPU_PRESETS["h200"], EFF, JOB).roofline
    assert h200 is not None
    assert h200.decode_tokens_per_second > 10_200


@pytest.mark.parametrize(
    "work",
    [
        cap.Workload(records=10, input_tokens=100, output_tokens=10, prefix_tokens=200),
        cap.Workload(records=10, input_tokens=100, output_tokens=0),
    ],
)
def test_impossible_inputs_are_refused(work: cap.Workload) -> None:
    with pytest.raises(ValueError):
        cap.plan_capacity(LLAMA_8B, H100, EFF, work)


def test_to_json_carries_the_figures(report: cap.CapacityReport) -> None:
    out = report.to_json()
    assert out["roofline"]["prefill_tokens_per_second"] == pytest.approx(30_906.25)
    assert out["estimate"]["milliseconds_per_record"] == pytest.approx(53.51, abs=0.01)
    assert out["model"]["kv_bytes_per_token"] == 131_072


def test_the_paid_fallback_buys_back_what_the_allowance_admits_interruptions_to_take() -> None:
    from batchline.sizing.capacity import Workload, job_estimate, paid_fallback

    work = Workload(records=3_600_000, input_tokens=100, output_tokens=10, deadline_hours=10.0,
                    price_per_gpu_hour=2.0, interruption_allowance=0.25)
    estimate = job_estimate(10.0, work)  # 100 GPU-hours: 10 GPUs flat out, 13 with the allowance
    fallback = paid_fallback(estimate, work, 6.0)
    assert (fallback.spot_workers, fallback.paid_workers) == (10, 3)
    assert fallback.worst_case_paid_hours == pytest.approx(25.0) and fallback.cost == pytest.approx(150.0)
    exact = Workload(records=3_600_000, input_tokens=100, output_tokens=10, deadline_hours=10.0,
                     interruption_allowance=0.0)
    none = paid_fallback(job_estimate(10.0, exact), exact, 6.0)
    assert (none.paid_workers, none.worst_case_paid_hours) == (0, 0.0)


def test_capacity_says_a_hosted_batch_is_no_fallback_for_a_deadline_shorter_than_its_window(
        capsys: pytest.CaptureFixture[str]) -> None:
    from batchline.cli import main

    assert main(["capacity", "--deadline-hours", "6"]) == 0
    out = capsys.readouterr().out
    assert "a fallback of up to" in out and "paid GPU-hours at $10.50" in out
    assert "not a fallback for this deadline: a hosted batch answers within 24 h at best" in out
    assert main(["capacity", "--deadline-hours", "30"]) == 0
    assert "not a fallback for this deadline" not in capsys.readouterr().out
