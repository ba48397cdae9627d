"""The vLLM engine without vLLM: the requests it builds, and its streaming loop on a stand-in."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from batchline.digests import sha256_tree
from batchline.engines import create_engine
from batchline.engines.base import EngineConfig
from batchline.engines.vllm_engine import VllmEngine, engine_kwargs, sampling_kwargs
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec, ModelSpec
from tests.engines.support import ListSource, make_request

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


class FakeLLMEngine:
    """Finishes each request after as many steps as its prompt has tokens, one token per step."""

    def __init__(self, events: list[str], too_long: int = 10**9) -> None:
        self.events = events
        self.too_long = too_long
        self.running: dict[str, tuple[int, int]] = {}
        self.steps = 0

    def add_request(self, request_id: str, prompt: dict[str, list[int]], params: Any) -> None:
        ids = prompt["prompt_token_ids"]
        if len(ids) >= self.too_long:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than max_model_len")
        self.events.append(f"add {request_id.split('#')[0]}")
        self.running[request_id] = (len(ids), 0)

    def step(self) -> list[_Output]:
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
    fake = FakeLLMEngine(events, too_long=int(options.get("too_long", 10**9)))
    engine._llm = fake
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


def test_a_record_vllm_refuses_is_that_records_error() -> None:
    events: list[str] = []
    engine, _ = _stub_engine(events, too_long=8)
    source = ListSource([make_request("ok", "p", "w"), make_request("huge", "p", "w " * 20)])
    outcomes = {o.record_id: o for o in engine.generate(source)}
    assert outcomes["ok"].error is None
    assert outcomes["huge"].error_kind == "engine_error"
    assert "max_model_len" in (outcomes["huge"].error or "")


def test_output_cut_at_max_tokens_is_an_error() -> None:
    from batchline.engines.vllm_engine import _InFlight, _outcome

    entry = _InFlight(make_request("r", "p", "w"), 3)
    cut = _Output("r#1", True, [_Completion('{"label": "', [1] * 64, "length")])
    outcome = _outcome(entry, cut, _config())
    assert outcome.error_kind == "engine_error" and "max_tokens=64" in (outcome.error or "")
    assert outcome.input_tokens == 3 and outcome.output_tokens == 64


def test_engine_step_failure_is_fatal() -> None:
    engine, fake = _stub_engine([])

    def dead() -> list[_Output]:
        raise RuntimeError("EngineDeadError: engine core died")

    fake.step = dead  # type: ignore[method-assign]
    with pytest.raises(EngineFatal, match="engine core died"):
        list(engine.generate(ListSource([make_request("r", "p", "w")])))
