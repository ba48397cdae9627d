"""The vLLM engine's arguments, sampling parameters and calls against the real vLLM
package, where no model needs to run: in .venv-vllm (vLLM's CPU build, `make test-vllm`)
and in .venv-vllm-cuda (the worker image's CUDA build, `make vllm-check`)."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from batchline.engines.base import EngineConfig, EngineRequest
from batchline.engines.vllm_engine import (
    VllmEngine,
    engine_kwargs,
    make_sampling_params,
    sampling_kwargs,
)
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import EXAMPLES, ListSource, make_request, save_tiny_llama
from tests.integration.engines.test_vllm_engine import _config, _stub_engine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm() -> Any:
    # Imported here, not at the top: collected without vLLM installed, the module is deselected.
    import vllm as module

    return module


TRIAGE_SCHEMA: dict[str, Any] = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))


def _triage_config(**options: Any) -> EngineConfig:
    return EngineConfig(
        model=ModelSpec(engine="vllm", path="/models/llama", options=options),
        # Sampled: vLLM sets top_p to 1 for greedy decoding, whatever it is given.
        decoding=DecodingSpec(temperature=0.7, max_tokens=200, seed=3, top_p=0.95),
        output_schema=TRIAGE_SCHEMA,
    )


def test_vllm_engine_args_take_every_argument_the_engine_passes(vllm: Any) -> None:
    kwargs = engine_kwargs(_triage_config(tensor_parallel_size=2, max_model_len=4096, dtype="bfloat16",
                                          enforce_eager=True, gpu_memory_utilization=0.5),
                           Path("/models/llama"))
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert set(kwargs) <= fields, set(kwargs) - fields
    args = vllm.EngineArgs(**kwargs)
    assert {key: getattr(args, key) for key in kwargs} == kwargs
    inspect.signature(vllm.LLMEngine.from_engine_args).bind(args)


def test_vllm_sampling_params_with_structured_outputs_build_from_the_jobs_schema(vllm: Any) -> None:
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


def test_the_engines_calls_bind_to_the_real_llm_engine(vllm: Any) -> None:
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


def test_conversations_render_through_the_chat_template_under_vllms_transformers(vllm: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    save_tiny_llama(tmp_path, hidden_size=256)
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
