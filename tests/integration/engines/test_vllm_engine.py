"""The vLLM engine: the requests it builds, its streaming loop on a stand-in, and
(where vLLM is installed: `make vllm-check` installs vllm==0.33.0 into .venv-vllm)
both checked against the real package wherever no GPU is needed."""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from batchline.digests import sha256_tree
from batchline.engines import create_engine
from batchline.engines.base import EngineConfig, EngineRequest
from batchline.engines.vllm_engine import (
    VllmEngine,
    _InFlight,
    _outcome,
    engine_kwargs,
    make_sampling_params,
    sampling_kwargs,
)
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import EXAMPLES, ListSource, make_request, save_tiny_llama

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
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("add_request", args, kwargs))
        request_id, prompt, _ = args
        ids = prompt["prompt_token_ids"]
        if len(ids) >= self.too_long:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than max_model_len")
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


def test_engine_step_failure_is_fatal() -> None:
    engine, fake = _stub_engine([])

    def dead() -> list[_Output]:
        raise RuntimeError("EngineDeadError: engine core died")

    fake.step = dead  # type: ignore[method-assign]
    with pytest.raises(EngineFatal, match="engine core died"):
        list(engine.generate(ListSource([make_request("r", "p", "w")])))


# --- the same against the real vLLM, where it is installed ---------------------------


def _vllm() -> Any:
    return pytest.importorskip("vllm", reason="vLLM is not installed here; `make vllm-check` "
                                              "runs these against vllm==0.33.0 in .venv-vllm")


TRIAGE_SCHEMA: dict[str, Any] = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))


def _triage_config(**options: Any) -> EngineConfig:
    return EngineConfig(
        model=ModelSpec(engine="vllm", path="/models/llama", options=options),
        # Sampled: vLLM sets top_p to 1 for greedy decoding, whatever it is given.
        decoding=DecodingSpec(temperature=0.7, max_tokens=200, seed=3, top_p=0.95),
        output_schema=TRIAGE_SCHEMA,
    )


@pytest.mark.engine
def test_vllm_engine_args_take_every_argument_the_engine_passes() -> None:
    vllm = _vllm()
    kwargs = engine_kwargs(_triage_config(tensor_parallel_size=2, max_model_len=4096, dtype="bfloat16",
                                          enforce_eager=True, gpu_memory_utilization=0.5),
                           Path("/models/llama"))
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert set(kwargs) <= fields, set(kwargs) - fields
    args = vllm.EngineArgs(**kwargs)
    assert {key: getattr(args, key) for key in kwargs} == kwargs
    inspect.signature(vllm.LLMEngine.from_engine_args).bind(args)


@pytest.mark.engine
def test_vllm_sampling_params_with_structured_outputs_build_from_the_jobs_schema() -> None:
    vllm = _vllm()
    from vllm.v1.structured_output.backend_xgrammar import (
        has_xgrammar_unsupported_json_features,
        validate_xgrammar_grammar,
    )

    params = make_sampling_params(vllm, sampling_kwargs(_triage_config()))
    assert isinstance(params, vllm.SamplingParams)
    assert params.structured_outputs.json == TRIAGE_SCHEMA
    assert (params.n, params.temperature, params.top_p, params.max_tokens, params.seed, params.ignore_eos) == (
        1, 0.7, 0.95, 200, 3, False)
    # vLLM's default backend ("auto") takes xgrammar for a schema it supports, and
    # xgrammar compiles this one.
    assert not has_xgrammar_unsupported_json_features(TRIAGE_SCHEMA)
    validate_xgrammar_grammar(params)
    plain = make_sampling_params(vllm, sampling_kwargs(_triage_config(constrained=False, ignore_eos=True)))
    assert plain.structured_outputs is None and plain.ignore_eos is True


@pytest.mark.engine
def test_the_engines_calls_bind_to_the_real_llm_engine() -> None:
    vllm = _vllm()
    from vllm.inputs import TokensPrompt

    engine, fake = _stub_engine([])
    outcomes = list(engine.generate(ListSource([make_request("r", "p", "w w")])))
    assert [o.record_id for o in outcomes] == ["r"]
    assert {name for name, _, _ in fake.calls} == {"add_request", "step"}
    for name, args, kwargs in fake.calls:
        inspect.signature(getattr(vllm.LLMEngine, name)).bind(object(), *args, **kwargs)
    _, (request_id, prompt, _), _ = fake.calls[0]
    assert isinstance(request_id, str)
    assert TokensPrompt.__required_keys__ <= set(prompt) <= set(TokensPrompt.__annotations__)
    # What the engine reads from step()'s outputs, and how close() stops vLLM.
    output_params = inspect.signature(vllm.RequestOutput.__init__).parameters
    assert {"request_id", "outputs", "finished"} <= set(output_params)
    assert {"text", "token_ids", "finish_reason"} <= {f.name for f in dataclasses.fields(vllm.CompletionOutput)}
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.core_client import EngineCoreClient

    assert {"stop", "length"} <= {str(reason) for reason in FinishReason}
    assert callable(EngineCoreClient.shutdown) and not hasattr(vllm.LLMEngine, "shutdown")
    assert "self.engine_core = " in inspect.getsource(vllm.LLMEngine.__init__)


@pytest.mark.engine
def test_conversations_render_through_the_chat_template_under_vllms_transformers(tmp_path: Path) -> None:
    _vllm()
    from transformers import AutoTokenizer

    save_tiny_llama(tmp_path)
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    engine = VllmEngine(_config(str(tmp_path), chat_template=template))
    engine._tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))  # what load() does after vLLM starts
    messages = ({"role": "system", "content": "Triage."}, {"role": "user", "content": "printer jammed"})
    prompt = engine.chat_prompt(messages)
    assert prompt == "<s>[system] Triage.\n[user] printer jammed\n[assistant] "
    ids = engine._prompt_ids(EngineRequest("c", prompt, "", "printer jammed", messages))
    # The template wrote the BOS; the tokenizer adds no second one.
    assert ids == engine._tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids.count(engine._tokenizer.bos_token_id) == 1


@pytest.mark.engine
def test_the_tiny_model_runs_through_vllm(tmp_path: Path) -> None:
    _vllm()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the vllm wheel on the index is built for CUDA only "
                    "(bench/vllm_cpu.py shows its CPU platform stopping)")
    save_tiny_llama(tmp_path)
    engine = VllmEngine(EngineConfig(
        model=ModelSpec(engine="vllm", path=str(tmp_path), digest="sha256:" + sha256_tree(tmp_path),
                        options={"max_model_len": 4096, "enforce_eager": True, "gpu_memory_utilization": 0.2,
                                 "max_num_seqs": 4}),
        decoding=DecodingSpec(temperature=0.0, max_tokens=300, seed=0),
        output_schema=TRIAGE_SCHEMA,
    ))
    engine.load()
    try:
        outcomes = list(engine.generate(ListSource(
            make_request(f"t-{i}", "Triage the ticket as JSON.\n", text)
            for i, text in enumerate(["laptop charger broken", "password reset please", "new monitor"]))))
    finally:
        engine.close()
    import jsonschema

    assert sorted(o.record_id for o in outcomes) == ["t-0", "t-1", "t-2"]
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
        jsonschema.validate(json.loads(outcome.output or ""), TRIAGE_SCHEMA)
        assert (outcome.finish_reason, outcome.constrained) == ("stop", True)


def test_sampling_params_carry_the_knobs_that_are_set_and_only_those() -> None:
    base = _config()
    assert not {"repetition_penalty", "frequency_penalty", "presence_penalty", "stop"} & set(sampling_kwargs(base))
    decoding = DecodingSpec(max_tokens=64, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                            stop=("END",))
    kwargs = sampling_kwargs(EngineConfig(model=base.model, decoding=decoding, output_schema=SCHEMA))
    assert (kwargs["repetition_penalty"], kwargs["frequency_penalty"], kwargs["presence_penalty"],
            kwargs["stop"]) == (1.3, 0.2, 0.1, ["END"])
