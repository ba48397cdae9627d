"""The vLLM engine: the requests it builds and its streaming loop, on a stand-in for
vLLM's LLMEngine (a fake: these run where vLLM is not installed). The same engine runs
the real vLLM in test_vllm_conformance.py and test_vllm_cpu.py (`make test-vllm`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from batchline.digests import sha256_tree
from batchline.engines import create_engine
from batchline.engines.base import EngineConfig
from batchline.engines.vllm_engine import (
    VllmEngine,
    _InFlight,
    _outcome,
    _require_devices,
    engine_kwargs,
    sampling_kwargs,
)
from batchline.errors import EngineCrashed, EngineFatal, SpecError
from batchline.spec import DecodingSpec, ModelSpec, parse_spec
from tests.integration.engines.support import ListSource, make_request

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}}, "required": ["label"]}


def _config(path: str | None = "/models/llama", digest: str | None = None, **options: Any) -> EngineConfig:
    return EngineConfig(
        model=ModelSpec(engine="vllm", path=path, digest=digest, options=options),
        decoding=DecodingSpec(temperature=0.0, max_tokens=64, seed=7, top_p=0.9),
        output_schema=SCHEMA,
    )


def test_sampling_params_carry_the_schema_and_decoding() -> None:
    kwargs = sampling_kwargs(_config())
    assert kwargs["structured_outputs"] == {"json": SCHEMA}
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["max_tokens"], kwargs["seed"]) == (0.0, 0.9, 64, 7)
    assert kwargs["ignore_eos"] is False
    assert "structured_outputs" not in sampling_kwargs(_config(constrained=False))


def test_engine_args_enable_prefix_caching_and_take_parallelism_from_the_spec() -> None:
    kwargs = engine_kwargs(_config(tensor_parallel_size=4, max_model_len=4096), Path("/models/llama"))
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["tensor_parallel_size"] == 4
    assert kwargs["max_num_seqs"] == 512
    assert kwargs["max_model_len"] == 4096
    assert kwargs["model"] == kwargs["tokenizer"] == "/models/llama"
    assert kwargs["seed"] == 7


def test_missing_vllm_or_gpu_is_one_clear_fatal_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    engine = create_engine(_config(str(tmp_path), "sha256:" + sha256_tree(tmp_path)))
    with pytest.raises(EngineFatal) as info:
        engine.load()
    message = str(info.value)
    assert "\n" not in message
    assert "vLLM" in message or "GPU" in message


def test_pinned_digest_is_checked_before_vllm_is_needed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    engine = create_engine(_config(str(tmp_path), "sha256:" + "1" * 64))
    with pytest.raises(EngineFatal, match="digest mismatch"):
        engine.load()


# --- the streaming loop, on a stand-in for vllm.LLMEngine ----------------------------


@dataclass
class _Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class _Output:
    request_id: str
    finished: bool
    outputs: list[_Completion]
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None


class FakeLLMEngine:
    """Finishes each request after as many steps as its prompt has tokens, one token per step."""

    def __init__(self, events: list[str], refuse: str = "") -> None:
        self.events = events
        self.refuse = refuse
        self.running: dict[str, tuple[int, int]] = {}
        self.steps = 0
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("add_request", args, kwargs))
        request_id, prompt, _ = args
        ids = prompt["prompt_token_ids"]
        if self.refuse and request_id.startswith(self.refuse):
            raise ValueError("this request's sampling parameters are not supported")
        self.events.append(f"add {request_id.split('#')[0]}")
        self.running[request_id] = (len(ids), 0)

    def step(self, *args: Any, **kwargs: Any) -> list[_Output]:
        self.calls.append(("step", args, kwargs))
        self.steps += 1
        self.events.append(f"step {self.steps}")
        outputs = []
        for request_id, (need, done) in list(self.running.items()):
            done += 1
            finished = done >= need
            self.running[request_id] = (need, done)
            if finished:
                del self.running[request_id]
            text = json.dumps({"label": "a"}) if finished else ""
            outputs.append(_Output(request_id, finished, [_Completion(text, list(range(done)), "stop" if finished else None)]))
        return outputs


def _stub_engine(events: list[str], **options: Any) -> tuple[VllmEngine, FakeLLMEngine]:
    engine = VllmEngine(_config(**options))
    fake = FakeLLMEngine(events, refuse=str(options.get("refuse", "")))
    engine._llm = fake
    engine._max_model_len = int(options.get("max_model_len", 10**9))
    engine._params = object()
    # One token per word keeps the expected step counts readable.
    engine.tokenize = lambda text: list(range(len(text.split())))  # type: ignore[method-assign]
    return engine, fake


def test_each_record_is_yielded_at_the_step_it_finishes() -> None:
    events: list[str] = []
    engine, _ = _stub_engine(events, max_num_seqs=8)
    requests = [make_request(rid, "p", text) for rid, text in
                [("long", "w " * 4), ("short", "w"), ("mid", "w w")]]
    # Rendered, the prompts have 2 more words than the text: long=6, short=3, mid=4 steps.
    for outcome in engine.generate(ListSource(requests)):
        events.append(f"yield {outcome.record_id}")
        assert outcome.error is None
        assert json.loads(outcome.output or "") == {"label": "a"}
    assert events.index("yield short") == events.index("step 3") + 1
    assert events.index("yield mid") == events.index("step 4") + 1
    assert events[-2:] == ["step 6", "yield long"]


def test_new_records_are_polled_while_others_run() -> None:
    events: list[str] = []
    engine, fake = _stub_engine(events, max_num_seqs=1, max_inflight=2)
    source = ListSource(make_request(f"r{i}", "p", "w") for i in range(5))
    outcomes = list(engine.generate(source))
    assert sorted(o.record_id for o in outcomes) == [f"r{i}" for i in range(5)]
    kinds = [kind for kind, _, _ in source.calls]
    # Blocking waits happen only when nothing is in flight; otherwise the engine polls.
    assert kinds[0] == "next_batch" and "poll" in kinds
    assert all(n <= 2 for _, n, _ in source.calls)
    assert fake.running == {}


def test_a_prompt_over_the_model_length_was_an_engine_error_charged_three_times() -> None:
    # It is too_long at once (a dead letter without a charge), costing no other record.
    events: list[str] = []
    engine, _ = _stub_engine(events, max_model_len=8)
    source = ListSource([make_request("ok", "p", "w"), make_request("huge", "p", "w " * 20),
                         make_request("edge", "p", "w " * 6)])
    outcomes = {o.record_id: o for o in engine.generate(source)}
    assert outcomes["ok"].error is None
    # 8 prompt tokens leave vLLM no room for one output token: too long as well.
    assert (outcomes["huge"].error_kind, outcomes["edge"].error_kind) == ("too_long", "too_long")
    assert outcomes["huge"].input_tokens == 22 and "max_model_len is 8" in (outcomes["huge"].error or "")
    assert [c for c in events if c.startswith("add")] == ["add ok"]


def test_a_request_vllm_refuses_for_another_reason_is_that_records_engine_error() -> None:
    engine, _ = _stub_engine([], refuse="bad")
    outcomes = {o.record_id: o for o in engine.generate(ListSource([make_request("ok", "p", "w"),
                                                                    make_request("bad", "p", "w")]))}
    assert outcomes["ok"].error is None
    assert outcomes["bad"].error_kind == "engine_error" and "not supported" in (outcomes["bad"].error or "")


def test_output_cut_at_max_tokens_is_an_error() -> None:
    entry = _InFlight(make_request("r", "p", "w"), 3)
    cut = _Output("r#1", True, [_Completion('{"label": "', [1] * 64, "length")])
    outcome = _outcome(entry, cut, _config())
    assert outcome.error_kind == "engine_error" and "max_tokens=64" in (outcome.error or "")
    assert outcome.input_tokens == 3 and outcome.output_tokens == 64
    assert (outcome.finish_reason, outcome.constrained) == ("length", True)


@pytest.mark.parametrize(("reason", "options", "expected"), [
    ("stop", {}, ("stop", True, False)),
    ("length", {"constrained": False, "ignore_eos": True}, ("length", False, False)),
    # vLLM 0.33's other endings are errors the worker may retry: no final reason.
    ("repetition", {}, (None, True, True)),
    ("abort", {"constrained": False}, (None, False, True)),
])
def test_outcomes_say_why_vllm_ended_and_whether_the_schema_held(
        reason: str, options: dict[str, Any], expected: tuple[str | None, bool, bool]) -> None:
    entry = _InFlight(make_request("r", "p", "w"), 3)
    done = _Output("r#1", True, [_Completion('{"label": "a"}', [1] * 5, reason)])
    outcome = _outcome(entry, done, _config(**options))
    assert (outcome.finish_reason, outcome.constrained, outcome.error is not None) == expected


def test_close_stops_the_engine_core() -> None:
    # vLLM 0.33's LLMEngine has no shutdown(); its engine-core client does.
    stopped: list[str] = []

    class Core:
        def shutdown(self) -> None:
            stopped.append("core")

    engine, fake = _stub_engine([])
    fake.engine_core = Core()  # type: ignore[attr-defined]
    engine.close()
    assert stopped == ["core"] and engine._llm is None


def test_an_engine_core_dying_mid_batch_was_reported_fatal_instead_of_a_crash_to_bisect() -> None:
    engine, fake = _stub_engine([])

    def dead() -> list[_Output]:
        raise RuntimeError("EngineCore encountered an issue")

    fake.step = dead  # type: ignore[method-assign]
    with pytest.raises(EngineCrashed, match="2 records in flight: RuntimeError: EngineCore encountered") as info:
        list(engine.generate(ListSource([make_request("r", "p", "w"), make_request("s", "p", "w")])))
    assert not isinstance(info.value, EngineFatal)


def test_require_gpus_refused_vllms_cpu_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    _require_devices(4, on_cpu=True)
    torch = pytest.importorskip("torch")
    # What the machine has is set here, so the check is the same on a GPU machine as on a CPU one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _require_devices(2, on_cpu=False)
    with pytest.raises(EngineFatal, match=r"needs 3 CUDA GPU\(s\) \(tensor_parallel_size\), 2 visible"):
        _require_devices(3, on_cpu=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineFatal, match=r"needs 1 CUDA GPU\(s\) \(tensor_parallel_size\), 0 visible"):
        _require_devices(1, on_cpu=False)


def test_structured_outputs_config_and_the_executor_backend_reach_vllm() -> None:
    kwargs = engine_kwargs(_config(distributed_executor_backend="uni",
                                   logits_processors=["pkg.mod:Proc"]), Path("/models/llama"))
    assert kwargs["distributed_executor_backend"] == "uni"
    assert kwargs["logits_processors"] == ["pkg.mod:Proc"]
    assert "distributed_executor_backend" not in engine_kwargs(_config(), Path("/m"))

    @dataclass
    class Config:  # vLLM's StructuredOutputsConfig refuses unknown fields the same way
        backend: str = "auto"
        disable_any_whitespace: bool = False

    from batchline.engines.vllm_engine import structured_outputs_config

    made = structured_outputs_config(Config, {"structured_outputs_config": {"backend": "xgrammar",
                                                                            "disable_any_whitespace": True}})
    assert made == Config("xgrammar", True)
    assert structured_outputs_config(Config, {}) is None
    with pytest.raises(EngineFatal, match=r"structured_outputs_config: .*disable_any_whitespaces"):
        structured_outputs_config(Config, {"structured_outputs_config": {"disable_any_whitespaces": True}})
    with pytest.raises(EngineFatal, match="must be a mapping"):
        structured_outputs_config(Config, {"structured_outputs_config": "xgrammar"})


def test_an_unknown_vllm_option_name_is_refused_when_the_job_is_planned(tmp_path: Path) -> None:
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    raw = {"name": "j", "input": {"path": "in.jsonl", "id_field": "id"},
           "model": {"engine": "vllm", "path": "/m", "options": {"max_num_seq": 8}},
           "prompt": {"text": "Classify.\n", "version": "v1"}, "output": {"schema": "schema.json"}}
    with pytest.raises(SpecError) as info:
        parse_spec(raw, tmp_path)
    assert str(info.value).endswith("model.options.max_num_seq: not an option of the vllm engine (its options: "
                                    "chat_template, constrained, distributed_executor_backend, dtype, "
                                    "enforce_eager, gpu_memory_utilization, ignore_eos, logits_processors, "
                                    "max_inflight, max_model_len, max_num_seqs, structured_outputs_config, "
                                    "tensor_parallel_size)")


def test_sampling_params_carry_the_knobs_that_are_set_and_only_those() -> None:
    base = _config()
    assert not {"repetition_penalty", "frequency_penalty", "presence_penalty", "stop"} & set(sampling_kwargs(base))
    decoding = DecodingSpec(max_tokens=64, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                            stop=("END",))
    kwargs = sampling_kwargs(EngineConfig(model=base.model, decoding=decoding, output_schema=SCHEMA))
    assert (kwargs["repetition_penalty"], kwargs["frequency_penalty"], kwargs["presence_penalty"],
            kwargs["stop"]) == (1.3, 0.2, 0.1, ["END"])
