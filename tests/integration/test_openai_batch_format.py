"""The openai-batch input format: lines as records, and every refusal as one line naming file:line."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.engines.base import EngineConfig, EngineRequest, chat_prompt, plain_chat_prompt
from batchline.engines.openai_engine import OpenAIEngine
from batchline.errors import InputError, SpecError
from batchline.plan.planner import plan
from batchline.snapshot import file_digest, scan
from batchline.spec import DecodingSpec, ModelSpec, load_spec, spec_from_store
from batchline.store import Store
from batchline.targets.openai_batch import openai_errors_path
from tests.helpers import SIMPLE_SCHEMA

DECODING = {"temperature": 0, "max_tokens": 64, "seed": 0, "top_p": 1.0}


def request(custom_id: str, text: str = "hello", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}], **body}}


def write_lines(path: Path, lines: list[Any]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def chat_spec(tmp_path: Path, lines: list[Any], *, input_extra: dict[str, Any] | None = None,
              **top: Any) -> Path:
    data = write_lines(tmp_path / "requests.jsonl", lines)
    spec: dict[str, Any] = {
        "name": "chat-job",
        "input": {"path": str(data), "format": "openai-batch", **(input_extra or {})},
        "model": {"engine": "synthetic"},
        "decoding": DECODING,
        "output": {"schema": SIMPLE_SCHEMA},
        **top,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_valid_file_plans_one_record_per_line_keyed_by_custom_id(tmp_path: Path, store: Store) -> None:
    lines = [
        request("q-1", "first question"),
        {"custom_id": "q-2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": "earlier"},
                               {"role": "assistant", "content": "noted"},
                               {"role": "user", "content": [{"type": "text", "text": "part one"},
                                                            {"type": "text", "text": "part two"}]}],
                  # The job's own settings, repeated, in either spelling, are welcome.
                  "max_completion_tokens": 64, "temperature": 0.0, "seed": 0, "top_p": 1, "n": 1,
                  "stream": False,
                  "response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "strict": True,
                                                      "schema": dict(reversed(SIMPLE_SCHEMA.items()))}}}},
        request("q-3", "third", max_tokens=64, response_format={"type": "json_object"}),
    ]
    spec = load_spec(chat_spec(tmp_path, lines))
    assert spec.prompt.text == "" and spec.prompt.version == "openai-batch"
    records = [s.record for s in scan(spec.input.locations[0], spec.input)]
    assert [r.id for r in records] == ["q-1", "q-2", "q-3"]
    assert [r.text for r in records] == ["first question", "part one\npart two", "third"]
    assert records[1].messages == (
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "earlier"},
        {"role": "assistant", "content": "noted"}, {"role": "user", "content": "part one\npart two"})
    result = plan(spec, store)
    assert (result.records, result.shards) == (3, 1)


def test_the_content_hash_covers_the_whole_conversation(tmp_path: Path) -> None:
    def record_hash(system: str) -> str:
        line = request("q-1", "same last turn")
        line["body"]["messages"].insert(0, {"role": "system", "content": system})
        (tmp_path / system).mkdir()
        spec = load_spec(chat_spec(tmp_path / system, [line]))
        return next(scan(spec.input.locations[0], spec.input)).record.content_hash

    assert record_hash("a") != record_hash("b")


MALFORMED: list[tuple[str, Any, str]] = [
    ("get", {**request("b"), "method": "GET"}, "custom_id 'b': method is 'GET'; batch requests are POST"),
    ("embeddings", {**request("b"), "url": "/v1/embeddings"},
     "custom_id 'b': url '/v1/embeddings' is not supported; only /v1/chat/completions is (chat completions)"),
    ("no id", {k: v for k, v in request("b").items() if k != "custom_id"}, "custom_id is missing"),
    ("empty id", request(""), "custom_id is '', not a non-empty string"),
    ("int id", {**request("b"), "custom_id": 7}, "custom_id is 7, not a non-empty string"),
    ("unknown field", {**request("b"), "priority": 1},
     "custom_id 'b': unknown field 'priority' (a line has custom_id, method, url, body)"),
    ("body", {**request("b"), "body": "hi"}, "custom_id 'b': body must be a JSON object"),
    ("no messages", {**request("b"), "body": {"messages": []}},
     "custom_id 'b': body.messages must be a non-empty list of {role, content} objects"),
    ("image", request("b", [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]),
     "custom_id 'b': body.messages[0].content[1] is a 'image_url' part; only text parts are supported"),
    ("null content", {**request("b"), "body": {"messages": [{"role": "user", "content": None}]}},
     "custom_id 'b': body.messages[0].content must be a string or a list of text parts, not null"),
    ("tool role", {**request("b"), "body": {"messages": [{"role": "user", "content": "x"},
                                                          {"role": "tool", "content": "y"}]}},
     "custom_id 'b': body.messages[1].role 'tool' is not supported"),
    ("tool calls", {**request("b"), "body": {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}},
     "custom_id 'b': body.messages[0].tool_calls is not supported"),
    ("no user", {**request("b"), "body": {"messages": [{"role": "system", "content": "x"}]}},
     "custom_id 'b': body.messages has no user message"),
    ("temperature", request("b", temperature=0.7),
     "custom_id 'b': body.temperature is 0.7 but the job's decoding.temperature is 0.0; an engine runs one "
     "decoding setting per job: set decoding in the job spec to match, or split the file by setting"),
    ("max_tokens", request("b", max_tokens=50), "body.max_tokens is 50 but the job's decoding.max_tokens is 64"),
    ("max_completion_tokens", request("b", max_completion_tokens=10),
     "body.max_completion_tokens is 10 but the job's decoding.max_tokens is 64"),
    ("seed", request("b", seed=3), "body.seed is 3 but the job's decoding.seed is 0"),
    ("top_p", request("b", top_p=0.9), "body.top_p is 0.9 but the job's decoding.top_p is 1.0"),
    ("stop", request("b", stop="END"), "body.stop is ['END'] but the job's decoding.stop is []; an engine runs"),
    ("empty stop", request("b", stop=["END", ""]), "body.stop must be a non-empty string or a list of them"),
    ("frequency_penalty", request("b", frequency_penalty=0.5),
     "body.frequency_penalty is 0.5 but the job's decoding.frequency_penalty is 0.0"),
    ("presence_penalty", request("b", presence_penalty=-1),
     "body.presence_penalty is -1 but the job's decoding.presence_penalty is 0.0"),
    ("repetition_penalty", request("b", repetition_penalty=1.3),
     "body.repetition_penalty is 1.3 but the job's decoding.repetition_penalty is 1.0"),
    ("schema", request("b", response_format={"type": "json_schema",
                                             "json_schema": {"name": "o", "schema": {"type": "object"}}}),
     "custom_id 'b': body.response_format.json_schema.schema differs from the job's output.schema"),
    ("text format", request("b", response_format={"type": "text"}),
     "custom_id 'b': body.response_format type 'text' is not supported"),
    ("n", request("b", n=2), "custom_id 'b': body.n is 2; batchline answers each custom_id once (n: 1)"),
    ("stream", request("b", stream=True), "custom_id 'b': body.stream is true; a batch answer is never streamed"),
    ("tools", request("b", tools=[]), "custom_id 'b': body.tools is not supported"),
    ("not json", '{"custom_id": "b",', "malformed JSON"),
    ("duplicate", request("a"), "duplicate id 'a' (first at "),
]


def test_lines_that_repeat_the_jobs_stop_and_penalties_are_welcome(tmp_path: Path, store: Store) -> None:
    decoding = {**DECODING, "stop": ["END"], "frequency_penalty": 0.5}
    lines = [request("q-1", stop="END", frequency_penalty=0.5),
             request("q-2", stop=["END"], presence_penalty=0, repetition_penalty=1.0),
             request("q-3", stop=None)]
    spec = load_spec(chat_spec(tmp_path, lines, decoding=decoding))
    assert plan(spec, store).records == 3
    other = load_spec(chat_spec(tmp_path, [request("q-4", stop="STOP")], decoding=decoding))
    with pytest.raises(InputError) as info:
        plan(other, store)
    assert "body.stop is ['STOP'] but the job's decoding.stop is ['END']" in str(info.value)


@pytest.mark.parametrize(("line", "message"), [(c[1], c[2]) for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_each_malformed_line_is_refused_with_one_line_and_nothing_is_planned(
        tmp_path: Path, store: Store, line: Any, message: str) -> None:
    spec = load_spec(chat_spec(tmp_path, [request("a"), line, request("c")]))
    with pytest.raises(InputError) as info:
        plan(spec, store)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{spec.input.locations[0]}:2: "), text
    assert message in text, text
    assert store.jobs() == []


def test_the_spec_needs_no_prompt_and_refuses_what_the_format_cannot_carry(tmp_path: Path) -> None:
    lines = [request("a")]
    assert load_spec(chat_spec(tmp_path, lines)).input.id_field == "custom_id"
    refusals = {
        "prompt": ({"prompt": {"text": "Classify.", "version": "v1"}},
                   "prompt: is not used with input.format openai-batch: each line's messages are its whole prompt"),
        "acl": ({"input_extra": {"acl_field": "acl"}}, "input.acl_field: an openai-batch line has no field"),
        "id": ({"input_extra": {"id_field": "id"}}, "input.id_field: is always 'custom_id'"),
        "routing": ({"routing": {"class_field": "c", "providers": {}}}, "routing: is not supported"),
    }
    for name, (extra, message) in refusals.items():
        (tmp_path / name).mkdir()
        with pytest.raises(SpecError, match=message.replace("(", r"\(")):
            load_spec(chat_spec(tmp_path / name, lines, **extra))
    # Every other format still needs its prompt.
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"name": "x", "input": {"path": str(tmp_path / "requests.jsonl")},
                                     "model": {"engine": "synthetic"}, "output": {"schema": SIMPLE_SCHEMA}}))
    with pytest.raises(SpecError, match="prompt: is required"):
        load_spec(plain)


def test_the_stored_spec_reads_back_to_the_same_version(tmp_path: Path) -> None:
    # Workers and the export rebuild the spec from its stored form; it must be the same job.
    spec = load_spec(chat_spec(tmp_path, [request("a")]))
    digest = file_digest(spec.input)
    again = spec_from_store(spec.to_dict())
    assert again.version(digest) == spec.version(digest)
    assert again.input.chat_rules == spec.input.chat_rules


def test_the_format_is_not_guessed_from_the_suffix(tmp_path: Path, store: Store) -> None:
    path = chat_spec(tmp_path, [request("a")])
    raw = yaml.safe_load(path.read_text())
    del raw["input"]["format"]
    raw["prompt"] = {"text": "x", "version": "v1"}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(InputError, match="missing id"):
        plan(load_spec(path), store)


def test_a_conversation_without_a_chat_template_gets_role_tagged_lines() -> None:
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    assert plain_chat_prompt(messages) == "system: Be brief.\nuser: Hi\nassistant:"

    class NoTemplate:
        pass

    class Templated:
        def chat_prompt(self, messages: Any) -> str:
            return f"<{len(messages)} messages>"

    assert chat_prompt(NoTemplate(), messages) == plain_chat_prompt(messages)  # type: ignore[arg-type]
    assert chat_prompt(Templated(), messages) == "<2 messages>"  # type: ignore[arg-type]


def test_the_openai_engine_sends_a_conversation_as_it_came() -> None:
    engine = OpenAIEngine(EngineConfig(model=ModelSpec(engine="openai", path="http://127.0.0.1:9/v1",
                                                       options={"model": "m"}),
                                       decoding=DecodingSpec(max_tokens=64), output_schema=SIMPLE_SCHEMA))
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    body = engine._body(EngineRequest("a", "system: Be brief.\nuser: Hi\nassistant:", "", "Hi", messages))
    assert body["messages"] == list(messages)
    plain = engine._body(EngineRequest("b", "PROMPT", "", "text"))
    assert plain["messages"] == [{"role": "user", "content": "PROMPT"}]


def test_the_error_file_goes_beside_the_output_file() -> None:
    assert openai_errors_path(Path("out/results.jsonl")) == Path("out/results.errors.jsonl")
    assert openai_errors_path(Path("results")) == Path("results.errors.jsonl")


def test_the_child_renders_conversations_and_a_refusing_template_fails_that_record_alone() -> None:
    from batchline.worker.child import _Source, _Writer

    class StrictTemplate:
        def chat_prompt(self, messages: Any) -> str:
            if messages[0]["role"] != "user":
                raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
            return "<turn>" + messages[-1]["content"]

        def count_tokens(self, text: str) -> int:
            return len(text)

    wire = io.StringIO()
    source = _Source(StrictTemplate(), _Writer(wire), None)  # type: ignore[arg-type]
    source.inbox.put(EngineRequest("bad", "", "", "x", ({"role": "assistant", "content": "x"},
                                                        {"role": "user", "content": "x"})))
    source.inbox.put(EngineRequest("chat", "", "", "hi", ({"role": "user", "content": "hi"},)))
    source.inbox.put(EngineRequest("plain", "PROMPT", "PRE", "text"))
    source.inbox.put(None)
    batch = source.next_batch(8)
    assert [(r.record_id, r.prompt, r.prefix) for r in batch] == [("chat", "<turn>hi", ""),
                                                                  ("plain", "PROMPT", "PRE")]
    [refused] = [json.loads(line) for line in wire.getvalue().splitlines()]
    assert refused["id"] == "bad" and refused["kind"] == "engine_error"
    assert refused["error"] == ("the chat template refused the conversation: ValueError: Conversation roles "
                                "must alternate user/assistant/user/assistant/...")
