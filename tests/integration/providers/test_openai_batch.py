"""The OpenAI Batch API client against the local stand-in server (tests/fakes/provider_servers.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from batchline.engines.base import EngineRequest, ListRequestSource
from batchline.errors import EngineFatal
from batchline.providers import open_provider
from batchline.providers.base import (
    BatchRequest,
    HostedBatchEngine,
    ProviderError,
    SubmittedBatch,
    custom_id_map,
)
from batchline.spec import DecodingSpec, ProviderSpec
from tests.fakes.provider_servers import FakeAnswerError, FakeOpenAIBatch, openai_batch_server
from tests.helpers import SIMPLE_SCHEMA
from tests.integration.providers.support import by_id, requests_for, run_to_end

pytest.importorskip("httpx")

from batchline.providers.openai_batch import (
    OpenAIBatchProvider,
    schema_name,
    strict_compatible,
)

KEY_ENV = "BATCHLINE_TEST_OPENAI_KEY"
DECODING = DecodingSpec(temperature=0.2, max_tokens=77, seed=5, top_p=0.9)


def echo_answer(custom_id: str, body: dict[str, Any]) -> str:
    """An answer that says which prompt it answers, so a mix-up between records shows."""
    return json.dumps({"category": "b", "summary": body["messages"][0]["content"][:30]})


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAIBatch]:
    with openai_batch_server(echo_answer) as fake:
        monkeypatch.setenv(KEY_ENV, fake.api_key)
        yield fake


def make_spec(base_url: str, **overrides: Any) -> ProviderSpec:
    fields: dict[str, Any] = {"route": "hosted", "api": "openai", "model": "gpt-4o-mini", "classes": ("public",),
                              "retention": "30 days", "base_url": base_url, "api_key_env": KEY_ENV,
                              "poll_seconds": 0.0}
    fields.update(overrides)
    return ProviderSpec(**fields)


def make_provider(server: FakeOpenAIBatch, job_name: str = "ticket triage/v1", **overrides: Any) -> OpenAIBatchProvider:
    return OpenAIBatchProvider(make_spec(server.base_url, **overrides), DECODING, SIMPLE_SCHEMA, job_name,
                               backoff_seconds=0.01)


def test_happy_path_submits_polls_and_answers_every_request(server: FakeOpenAIBatch) -> None:
    server.complete_after_polls = 2
    server.served_model = "gpt-4o-mini-2024-07-18"
    provider = make_provider(server, options={"service_tier": "flex"})
    ids = ["r0", "r1", "r2", "r3"]
    batch = provider.submit(requests_for(*ids), tag="v1/7/3")

    assert batch.api == "openai" and batch.request_count == 4 and batch.tag == "v1/7/3"
    assert batch.input_file_id and batch.batch_id == server.submissions[0]["id"]
    assert run_to_end(provider, batch) == ["in_progress", "in_progress", "completed"]

    answers = by_id(list(provider.answers(batch)))
    assert set(answers) == set(ids)
    for custom_id, answer in answers.items():
        assert answer.kind == "ok" and answer.model == "gpt-4o-mini-2024-07-18"
        output = json.loads(answer.output or "")
        jsonschema.validate(output, SIMPLE_SCHEMA)
        assert output["summary"] == f"prompt of {custom_id}"[:30]
        assert answer.input_tokens and answer.output_tokens
    assert server.downloads == 1  # no error file: nothing failed

    submission = server.submissions[0]
    assert submission["metadata"] == {"batchline_tag": "v1/7/3"}
    body = submission["lines"][0]["body"]
    assert body["model"] == "gpt-4o-mini"
    assert body["messages"] == [{"role": "user", "content": "prompt of r0"}]
    assert (body["max_completion_tokens"], body["temperature"], body["top_p"], body["seed"]) == (77, 0.2, 0.9, 5)
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "ticket_triage_v1", "schema": SIMPLE_SCHEMA, "strict": True}}
    assert body["service_tier"] == "flex"


def test_options_override_and_a_null_option_removes_a_field(server: FakeOpenAIBatch) -> None:
    provider = make_provider(server, options={"temperature": None, "top_p": None, "seed": 11})
    provider.submit(requests_for("a"), tag="t")
    body = server.submissions[0]["lines"][0]["body"]
    assert "temperature" not in body and "top_p" not in body and body["seed"] == 11


def test_strict_mode_only_for_schemas_that_meet_its_rules() -> None:
    assert strict_compatible(SIMPLE_SCHEMA)
    nested_ok = {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
        "a": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "string"}},
                                         "required": ["x"], "additionalProperties": False}},
        "b": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/c"}]}},
        "$defs": {"c": {"type": "object", "properties": {}, "required": [], "additionalProperties": False}}}
    assert strict_compatible(nested_ok)
    optional = {**SIMPLE_SCHEMA, "required": ["category"]}
    open_object = {k: v for k, v in SIMPLE_SCHEMA.items() if k != "additionalProperties"}
    nested_open = json.loads(json.dumps(nested_ok))
    nested_open["properties"]["a"]["items"]["additionalProperties"] = True
    def_optional = json.loads(json.dumps(nested_ok))
    def_optional["$defs"]["c"] = {"type": "object", "properties": {"y": {}}, "additionalProperties": False}
    for schema in (optional, open_object, nested_open, def_optional, {"type": "string"}):
        assert not strict_compatible(schema), schema


def test_a_schema_outside_strict_rules_is_sent_non_strict(server: FakeOpenAIBatch) -> None:
    loose = {"type": "object", "properties": {"category": {"enum": ["a", "b"]}}, "required": ["category"]}
    provider = OpenAIBatchProvider(make_spec(server.base_url), DECODING, loose, "job")
    provider.submit(requests_for("a"), tag="t")
    fmt = server.submissions[0]["lines"][0]["body"]["response_format"]["json_schema"]
    assert fmt["strict"] is False and fmt["schema"] == loose


def test_schema_name_is_what_the_api_takes() -> None:
    assert schema_name("ticket-triage v2/ü") == "ticket-triage_v2__"
    assert len(schema_name("x" * 100)) == 64
    assert schema_name("") == "output"


def test_expired_requests_come_back_expired(server: FakeOpenAIBatch) -> None:
    server.expire_ids = {"r1", "r2"}
    server.batch_status_on_end = "expired"
    provider = make_provider(server)
    batch = provider.submit(requests_for("r0", "r1", "r2"), tag="t")
    progress = provider.progress(batch)
    assert progress.ended and progress.status == "expired" and progress.error is None
    answers = by_id(list(provider.answers(batch)))
    assert {k: a.kind for k, a in answers.items()} == {"r0": "ok", "r1": "expired", "r2": "expired"}
    assert server.downloads == 2  # the output file and the error file


def test_partial_errors_are_per_request(server: FakeOpenAIBatch) -> None:
    def answer(custom_id: str, body: dict[str, Any]) -> str:
        if custom_id == "r3":
            raise FakeAnswerError("Invalid schema for response_format")
        return echo_answer(custom_id, body)

    server.answer = answer
    server.error_ids = {"r1"}
    provider = make_provider(server)
    batch = provider.submit(requests_for("r0", "r1", "r2", "r3"), tag="t")
    run_to_end(provider, batch)
    answers = by_id(list(provider.answers(batch)))
    assert answers["r0"].kind == answers["r2"].kind == "ok"
    assert answers["r1"].kind == "error" and answers["r1"].error is not None
    assert answers["r1"].error.startswith("HTTP 500: server_error")
    assert answers["r3"].kind == "error" and "Invalid schema for response_format" in (answers["r3"].error or "")
    assert provider.progress(batch).counts == {"total": 4, "completed": 2, "failed": 2}


def test_duplicate_answers_surface_as_two_answers(server: FakeOpenAIBatch) -> None:
    server.duplicate_ids = {"r0"}
    server.answer = server.default_answer  # varies with the custom id, so the second answer differs
    provider = make_provider(server)
    batch = provider.submit(requests_for("r0", "r1"), tag="t")
    run_to_end(provider, batch)
    answers = list(provider.answers(batch))
    twice = [a for a in answers if a.custom_id == "r0"]
    assert len(twice) == 2 and all(a.kind == "ok" for a in twice)
    assert twice[0].output != twice[1].output
    assert [a.custom_id for a in answers].count("r1") == 1


def test_a_batch_that_fails_validation_ends_with_its_error(server: FakeOpenAIBatch) -> None:
    server.fail_batch = True
    provider = make_provider(server)
    batch = provider.submit(requests_for("r0"), tag="t")
    progress = provider.progress(batch)
    assert progress.ended and progress.status == "failed"
    assert progress.error is not None and "does not exist" in progress.error and "line 1" in progress.error
    assert list(provider.answers(batch)) == []
    # ... and is never adopted: it never ran.
    assert provider.find("t", 1, since=0) is None


def test_find_adopts_a_submitted_batch_by_its_tag(server: FakeOpenAIBatch) -> None:
    provider = make_provider(server)
    since = server.clock()
    first = provider.submit(requests_for("a", "b"), tag="v1/0/1")
    provider.submit(requests_for("a"), tag="v1/1/1")
    provider.submit(requests_for("a"), tag="v1/2/1")

    # A worker that died before recording the batch id: a new client finds it, paging back.
    other = make_provider(server)
    other.page_size = 1
    found = other.find("v1/0/1", 2, since=since)
    assert found is not None and found.batch_id == first.batch_id and found.tag == "v1/0/1"
    assert found.request_count == 2 and found.input_file_id == first.input_file_id
    assert sum(1 for r in server.request_log if r["path"] == "/v1/batches" and r["method"] == "GET") == 3

    assert other.find("v1/9/9", 2, since=since) is None
    assert other.find("v1/0/1", 2, since=since + 3600) is None  # made before the window looked at


def test_a_lost_create_reply_adopts_the_batch_instead_of_paying_twice(server: FakeOpenAIBatch) -> None:
    server.drop_create_replies = 1
    provider = make_provider(server)
    batch = provider.submit(requests_for("a", "b"), tag="v1/4/2")
    assert len(server.submissions) == 1
    assert batch.batch_id == server.submissions[0]["id"]


def test_ids_that_need_mapping_round_trip(server: FakeOpenAIBatch) -> None:
    provider = make_provider(server)
    record_ids = ["plain-1", "tickets/2024/7", "ünïcødé", "x" * 80, "bl-looks-mapped", "with space", "a.b:c"]
    mapping = custom_id_map(record_ids, provider.acceptable_custom_id)
    assert mapping["plain-1"] == "plain-1" and mapping["a.b:c"] == "a.b:c"  # acceptable ids stay as they are
    custom_of = {record: custom for custom, record in mapping.items()}
    batch = provider.submit([BatchRequest(custom_of[r], f"prompt of {r}") for r in record_ids], tag="t")
    run_to_end(provider, batch)
    sent = [line["custom_id"] for line in server.submissions[0]["lines"]]
    assert all(provider.acceptable_custom_id(c) for c in sent)
    answers = list(provider.answers(batch))
    assert sorted(mapping[a.custom_id] for a in answers) == sorted(record_ids)
    for a in answers:
        assert json.loads(a.output or "")["summary"] == f"prompt of {mapping[a.custom_id]}"[:30]


def test_acceptable_custom_id() -> None:
    ok = OpenAIBatchProvider.acceptable_custom_id
    provider: Any = None
    assert ok(provider, "a") and ok(provider, "A-z_0.9:x") and ok(provider, "x" * 64)
    for bad in ("", "x" * 65, "a/b", "a b", "é", "a\n"):
        assert not ok(provider, bad), bad


def test_a_missing_api_key_is_fatal_and_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHLINE_TEST_NO_KEY", raising=False)
    with pytest.raises(ProviderError) as info:
        OpenAIBatchProvider(make_spec("http://127.0.0.1:9", api_key_env="BATCHLINE_TEST_NO_KEY"),
                            DECODING, SIMPLE_SCHEMA, "job")
    assert info.value.fatal and "BATCHLINE_TEST_NO_KEY" in str(info.value)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ProviderError, match="OPENAI_API_KEY") as default:
        OpenAIBatchProvider(make_spec("http://127.0.0.1:9", api_key_env=None), DECODING, SIMPLE_SCHEMA, "job")
    assert default.value.fatal


def test_a_refused_key_is_fatal(server: FakeOpenAIBatch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    provider = make_provider(server)
    with pytest.raises(ProviderError) as info:
        provider.submit(requests_for("a"), tag="t")
    assert info.value.fatal and "401" in str(info.value)
    assert len(server.request_log) == 1  # not retried


def test_rate_limits_are_retried(server: FakeOpenAIBatch) -> None:
    server.fail_next = [429, 429, 503]
    provider = make_provider(server)
    batch = provider.submit(requests_for("a"), tag="t")
    assert batch.batch_id == server.submissions[0]["id"]
    assert [r["status"] for r in server.request_log][:4] == [429, 429, 503, 200]
    assert provider.http.retries == 3


def test_retries_give_up_with_a_non_fatal_error(server: FakeOpenAIBatch) -> None:
    server.fail_next = [503] * 10
    provider = OpenAIBatchProvider(make_spec(server.base_url), DECODING, SIMPLE_SCHEMA, "job", max_tries=3,
                                   backoff_seconds=0.001)
    with pytest.raises(ProviderError, match="gave up after 3 tries") as info:
        provider.progress(SubmittedBatch("openai", "batch_x", "t", 1, 0.0))
    assert not info.value.fatal and len(server.request_log) == 3


def test_other_client_errors_carry_the_servers_message(server: FakeOpenAIBatch) -> None:
    provider = make_provider(server, completion_window="48h")
    with pytest.raises(ProviderError, match="completion_window must be '24h'") as info:
        provider.submit(requests_for("a"), tag="t")
    assert not info.value.fatal
    assert [r["status"] for r in server.request_log] == [200, 400]  # the upload, then the refused create


def test_an_unreadable_line_is_skipped_and_kept(server: FakeOpenAIBatch) -> None:
    server.extra_output_lines = ["{not json", json.dumps({"custom_id": "r9", "response": None, "error": None})]
    provider = make_provider(server)
    batch = provider.submit(requests_for("r0", "r1"), tag="t")
    run_to_end(provider, batch)
    answers = by_id(list(provider.answers(batch)))
    assert set(answers) == {"r0", "r1"}
    assert len(provider.problems) == 2 and "line 3" in provider.problems[0]


def test_open_provider_chooses_by_api(server: FakeOpenAIBatch) -> None:
    provider = open_provider(make_spec(server.base_url), DECODING, SIMPLE_SCHEMA, "job")
    assert isinstance(provider, OpenAIBatchProvider)
    with pytest.raises(ProviderError, match="unknown provider api") as info:
        open_provider(make_spec(server.base_url, api="gemini"), DECODING, SIMPLE_SCHEMA, "job")
    assert info.value.fatal


def test_hosted_batch_engine_runs_a_provider_in_process(server: FakeOpenAIBatch) -> None:
    server.complete_after_polls = 1
    server.expire_ids = {"b"}  # custom ids: "b" is acceptable as it is
    slept: list[float] = []
    engine = HostedBatchEngine(make_spec(server.base_url, poll_seconds=7.0), DECODING, SIMPLE_SCHEMA, "job",
                               sleep=slept.append)
    engine.load()
    records = ["a", "b", "c/3", "bl-x"]
    source = ListRequestSource([EngineRequest(r, f"prompt of {r}", "", r) for r in records])
    outcomes = {o.record_id: o for o in engine.generate(source)}
    engine.close()

    assert set(outcomes) == set(records)
    assert outcomes["b"].error == "expired at the provider" and outcomes["b"].error_kind == "engine_error"
    for r in ("a", "c/3", "bl-x"):
        assert outcomes[r].error is None
        assert json.loads(outcomes[r].output or "")["summary"] == f"prompt of {r}"[:30]
    assert slept == [7.0]  # one poll saw it in progress, the next saw it end
    assert len(server.submissions) == 1 and len(server.submissions[0]["lines"]) == 4
    assert engine.count_tokens("abcdef") == 3


def test_hosted_batch_engine_without_a_key_fails_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHLINE_TEST_NO_KEY", raising=False)
    engine = HostedBatchEngine(make_spec("http://127.0.0.1:9", api_key_env="BATCHLINE_TEST_NO_KEY"),
                               DECODING, SIMPLE_SCHEMA, "job")
    with pytest.raises(EngineFatal, match="BATCHLINE_TEST_NO_KEY"):
        engine.load()


def test_hosted_batch_engine_turns_a_failed_batch_fatal(server: FakeOpenAIBatch) -> None:
    server.fail_batch = True
    engine = HostedBatchEngine(make_spec(server.base_url), DECODING, SIMPLE_SCHEMA, "job", sleep=lambda s: None)
    engine.load()
    with pytest.raises(EngineFatal, match="failed"):
        list(engine.generate(ListRequestSource([EngineRequest("a", "p", "", "a")])))


def test_a_batch_over_the_api_limits_is_refused_before_upload(server: FakeOpenAIBatch,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import batchline.providers.openai_batch as module

    monkeypatch.setattr(module, "MAX_REQUESTS", 2)
    with pytest.raises(ProviderError, match="shard_size") as info:
        make_provider(server).submit(requests_for("a", "b", "c"), tag="t")
    assert info.value.fatal and server.request_log == []


def test_request_lines_carry_the_jobs_penalties_and_stop_sequences(server: FakeOpenAIBatch) -> None:
    decoding = DecodingSpec(max_tokens=77, frequency_penalty=0.4, presence_penalty=0.2, stop=("END",))
    provider = OpenAIBatchProvider(make_spec(server.base_url), decoding, SIMPLE_SCHEMA, "job", backoff_seconds=0.01)
    provider.submit(requests_for("a"), tag="t")
    body = server.submissions[0]["lines"][0]["body"]
    assert (body["frequency_penalty"], body["presence_penalty"], body["stop"]) == (0.4, 0.2, ["END"])
    plain = make_provider(server).request_body("p")
    assert not {"frequency_penalty", "presence_penalty", "stop"} & set(plain)
