"""The Anthropic Message Batches client against the local stand-in server
(tests/fakes/provider_servers.py), and the custom id mapping both providers share."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline.providers import open_provider
from batchline.providers.base import (
    BatchRequest,
    ProviderError,
    SubmittedBatch,
    custom_id_map,
)
from batchline.spec import DecodingSpec, ProviderSpec
from tests.fakes.provider_servers import FakeAnswerError, FakeAnthropicBatch, anthropic_batch_server
from tests.helpers import SIMPLE_SCHEMA
from tests.integration.providers.support import by_id, requests_for, run_to_end

pytest.importorskip("httpx")

from batchline.providers.anthropic_batch import AnthropicBatchProvider, parse_time
from batchline.providers.openai_batch import OpenAIBatchProvider

KEY_ENV = "BATCHLINE_TEST_ANTHROPIC_KEY"
DECODING = DecodingSpec(temperature=0.0, max_tokens=64, seed=3, top_p=1.0)


def echo_answer(custom_id: str, params: dict[str, Any]) -> str:
    """An answer that says which prompt it answers, so a mix-up between records shows."""
    return json.dumps({"category": "c", "summary": params["messages"][0]["content"][:30]})


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAnthropicBatch]:
    with anthropic_batch_server(echo_answer) as fake:
        monkeypatch.setenv(KEY_ENV, fake.api_key)
        yield fake


def make_spec(base_url: str, **overrides: Any) -> ProviderSpec:
    fields: dict[str, Any] = {"route": "claude", "api": "anthropic", "model": "claude-haiku-4-5",
                              "classes": ("public",), "retention": "none", "base_url": base_url,
                              "api_key_env": KEY_ENV, "poll_seconds": 0.0}
    fields.update(overrides)
    return ProviderSpec(**fields)


def make_provider(server: FakeAnthropicBatch, decoding: DecodingSpec = DECODING,
                  **overrides: Any) -> AnthropicBatchProvider:
    return AnthropicBatchProvider(make_spec(server.base_url, **overrides), decoding, SIMPLE_SCHEMA, "triage",
                                  backoff_seconds=0.01)


def test_happy_path_forces_the_tool_and_answers_every_request(server: FakeAnthropicBatch) -> None:
    server.complete_after_polls = 2
    server.served_model = "claude-haiku-4-5-20251001"
    provider = make_provider(server, options={"metadata": {"user_id": "batchline"}})
    ids = ["r0", "r1", "r2"]
    batch = provider.submit(requests_for(*ids), tag="v1/3/1")

    assert batch.api == "anthropic" and batch.tag == "v1/3/1" and batch.request_count == 3
    assert batch.batch_id == server.submissions[0]["id"]
    assert run_to_end(provider, batch) == ["in_progress", "in_progress", "ended"]
    assert provider.progress(batch).counts == {"processing": 0, "succeeded": 3, "errored": 0, "canceled": 0,
                                               "expired": 0}

    answers = by_id(list(provider.answers(batch)))
    assert set(answers) == set(ids)
    for custom_id, answer in answers.items():
        assert answer.kind == "ok" and answer.model == "claude-haiku-4-5-20251001"
        output = json.loads(answer.output or "")
        jsonschema.validate(output, SIMPLE_SCHEMA)
        assert output["summary"] == f"prompt of {custom_id}"[:30]
        assert answer.input_tokens and answer.output_tokens
    assert server.downloads == 1

    params = server.submissions[0]["lines"][0]["params"]
    assert params["model"] == "claude-haiku-4-5" and params["max_tokens"] == 64
    assert params["messages"] == [{"role": "user", "content": "prompt of r0"}]
    assert params["temperature"] == 0.0 and "top_p" not in params  # top_p 1 restricts nothing
    assert [t["name"] for t in params["tools"]] == ["record_output"]
    assert params["tools"][0]["input_schema"] == SIMPLE_SCHEMA
    assert params["tool_choice"] == {"type": "tool", "name": "record_output"}
    assert params["metadata"] == {"user_id": "batchline"}
    create = next(r for r in server.request_log if r["method"] == "POST")
    assert create["headers"]["anthropic-version"] == "2023-06-01"


def test_top_p_is_sent_when_it_restricts(server: FakeAnthropicBatch) -> None:
    provider = make_provider(server, DecodingSpec(temperature=0.5, max_tokens=10, top_p=0.8),
                             options={"temperature": None})
    provider.submit(requests_for("a"), tag="t")
    params = server.submissions[0]["lines"][0]["params"]
    assert params["top_p"] == 0.8 and "temperature" not in params


def test_a_text_answer_is_taken_when_there_is_no_tool_call(server: FakeAnthropicBatch) -> None:
    server.answer = lambda custom_id, params: f"plain words for {custom_id}"
    provider = make_provider(server)
    batch = provider.submit(requests_for("a"), tag="t")
    run_to_end(provider, batch)
    [answer] = provider.answers(batch)
    assert answer.kind == "ok" and answer.output == "plain words for a"


def test_expired_requests_come_back_expired(server: FakeAnthropicBatch) -> None:
    server.expire_ids = {"r1"}
    provider = make_provider(server)
    batch = provider.submit(requests_for("r0", "r1"), tag="t")
    run_to_end(provider, batch)
    answers = by_id(list(provider.answers(batch)))
    assert {k: a.kind for k, a in answers.items()} == {"r0": "ok", "r1": "expired"}
    assert provider.progress(batch).counts["expired"] == 1


def test_partial_errors_are_per_request(server: FakeAnthropicBatch) -> None:
    def answer(custom_id: str, params: dict[str, Any]) -> str:
        if custom_id == "r2":
            raise FakeAnswerError("prompt is too long: 300000 tokens > 200000 maximum")
        return echo_answer(custom_id, params)

    server.answer = answer
    server.error_ids = {"r1"}
    provider = make_provider(server)
    batch = provider.submit(requests_for("r0", "r1", "r2"), tag="t")
    run_to_end(provider, batch)
    answers = by_id(list(provider.answers(batch)))
    assert answers["r0"].kind == "ok"
    assert answers["r1"].kind == "error" and answers["r1"].error == "invalid_request_error: bad request (fake)"
    assert answers["r2"].kind == "error" and "prompt is too long" in (answers["r2"].error or "")


def test_duplicate_answers_surface_as_two_answers(server: FakeAnthropicBatch) -> None:
    server.duplicate_ids = {"r1"}
    server.answer = server.default_answer
    provider = make_provider(server)
    batch = provider.submit(requests_for("r0", "r1"), tag="t")
    run_to_end(provider, batch)
    twice = [a for a in provider.answers(batch) if a.custom_id == "r1"]
    assert len(twice) == 2 and all(a.kind == "ok" for a in twice)
    assert twice[0].output != twice[1].output


def test_a_refused_batch_is_a_provider_error(server: FakeAnthropicBatch) -> None:
    server.fail_batch = True
    provider = make_provider(server)
    with pytest.raises(ProviderError, match="invalid_request_error: the batch was refused") as info:
        provider.submit(requests_for("r0"), tag="t")
    assert not info.value.fatal and server.submissions == []


def test_find_adopts_the_one_batch_of_that_size_since_submission(server: FakeAnthropicBatch) -> None:
    provider = make_provider(server)
    older = provider.submit(requests_for("a", "b", "c"), tag="v1/0/1")
    since = server.clock() + 1000
    server.clock = lambda: since + 5  # the batches below are made after `since`
    mine = provider.submit(requests_for("a", "b"), tag="v1/1/1")
    provider.submit(requests_for("a"), tag="v1/2/1")
    provider.submit(requests_for("a", "b", "c", "d"), tag="v1/3/1")

    other = make_provider(server)
    other.page_size = 1
    found = other.find("v1/1/1", 2, since=since)
    assert found is not None and found.batch_id == mine.batch_id and found.tag == "v1/1/1"
    assert other.find("v1/5/1", 5, since=since) is None  # nothing of that size
    assert other.find("v1/0/1", 3, since=since) is None  # the 3-request batch is older than `since`
    found_old = other.find("v1/0/1", 3, since=since - 1000)
    assert found_old is not None and found_old.batch_id == older.batch_id

    provider.submit(requests_for("x", "y"), tag="v1/4/1")
    assert other.find("v1/1/1", 2, since=since) is None  # two candidates: not certain, not adopted


def test_a_lost_create_reply_adopts_the_batch_instead_of_paying_twice(server: FakeAnthropicBatch) -> None:
    server.drop_create_replies = 1
    provider = make_provider(server)
    batch = provider.submit(requests_for("a", "b"), tag="t")
    assert len(server.submissions) == 1 and batch.batch_id == server.submissions[0]["id"]


def test_ids_that_need_mapping_round_trip(server: FakeAnthropicBatch) -> None:
    provider = make_provider(server)
    record_ids = ["plain_1", "a.b:c", "tickets/2024/7", "ünïcødé", "y" * 70, "bl-abc", "with space"]
    mapping = custom_id_map(record_ids, provider.acceptable_custom_id)
    assert mapping["plain_1"] == "plain_1" and "a.b:c" not in mapping  # dots and colons are not taken here
    custom_of = {record: custom for custom, record in mapping.items()}
    batch = provider.submit([BatchRequest(custom_of[r], f"prompt of {r}") for r in record_ids], tag="t")
    run_to_end(provider, batch)
    answers = list(provider.answers(batch))
    assert sorted(mapping[a.custom_id] for a in answers) == sorted(record_ids)
    for a in answers:
        assert json.loads(a.output or "")["summary"] == f"prompt of {mapping[a.custom_id]}"[:30]


def test_the_fake_refuses_what_the_real_api_refuses(server: FakeAnthropicBatch) -> None:
    # The checks that make the fake worth testing against: a client that sends these is told so.
    provider = make_provider(server)
    with pytest.raises(ProviderError, match="custom_id"):
        provider.submit(requests_for("a.b"), tag="t")
    with pytest.raises(ProviderError, match="duplicate"):
        provider.submit(requests_for("a", "a"), tag="t")
    provider.http.headers.pop("anthropic-version")
    with pytest.raises(ProviderError, match="anthropic-version"):
        provider.submit(requests_for("a"), tag="t")


def test_acceptable_custom_id() -> None:
    assert anthropic_accepts("a") and anthropic_accepts("A-z_09") and anthropic_accepts("x" * 64)
    for bad in ("", "x" * 65, "a.b", "a:b", "a/b", "é", "a\n"):
        assert not anthropic_accepts(bad), bad


def test_a_missing_api_key_is_fatal_and_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ProviderError, match="ANTHROPIC_API_KEY") as info:
        open_provider(make_spec("http://127.0.0.1:9", api_key_env=None), DECODING, SIMPLE_SCHEMA, "job")
    assert info.value.fatal


def test_a_refused_key_is_fatal(server: FakeAnthropicBatch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "wrong")
    provider = make_provider(server)
    with pytest.raises(ProviderError, match="authentication_error") as info:
        provider.progress(SubmittedBatch("anthropic", "msgbatch_x", "t", 1, 0.0))
    assert info.value.fatal and len(server.request_log) == 1


def test_rate_limits_and_overload_are_retried(server: FakeAnthropicBatch) -> None:
    provider = make_provider(server)
    batch = provider.submit(requests_for("a"), tag="t")
    server.fail_next = [429, 529, 429]
    assert provider.progress(batch).ended
    assert [r["status"] for r in server.request_log][1:] == [429, 529, 429, 200]
    assert provider.http.retries == 3


def test_a_download_is_retried_when_it_cannot_be_opened(server: FakeAnthropicBatch) -> None:
    provider = make_provider(server)
    batch = provider.submit(requests_for("a", "b"), tag="t")
    run_to_end(provider, batch)
    server.fail_downloads = [529, 500]
    assert sorted(a.custom_id for a in provider.answers(batch)) == ["a", "b"]
    assert server.downloads == 3 and provider.http.retries == 2


def test_an_unreadable_line_is_skipped_and_kept(server: FakeAnthropicBatch) -> None:
    server.extra_output_lines = ["garbage", json.dumps({"custom_id": "z", "result": {"type": "mystery"}})]
    provider = make_provider(server)
    batch = provider.submit(requests_for("r0"), tag="t")
    run_to_end(provider, batch)
    assert [a.custom_id for a in provider.answers(batch)] == ["r0"]
    assert len(provider.problems) == 2 and "mystery" in provider.problems[1]


def test_parse_time_reads_rfc3339() -> None:
    assert parse_time("2024-08-20T18:37:24.100435Z") == pytest.approx(
        dt.datetime(2024, 8, 20, 18, 37, 24, 100435, tzinfo=dt.UTC).timestamp())
    assert parse_time(None) == 0.0 and parse_time("yesterday") == 0.0


# --- custom_id_map: shared by both providers ----------------------------------------------

TRICKY = ["plain", "ünïcødé", "a/b/c", "a b", "x" * 65, "x" * 200, "bl-plain", "bl-", "bl-h-0123",
          "YS9i", "bl-YS9i", "", "a.b:c", "🙂", "tab\there"]


def anthropic_accepts(value: str) -> bool:
    return AnthropicBatchProvider.acceptable_custom_id(Any, value)  # type: ignore[arg-type]  # no state used


def openai_accepts(value: str) -> bool:
    return OpenAIBatchProvider.acceptable_custom_id(Any, value)  # type: ignore[arg-type]


@pytest.mark.parametrize("acceptable", [anthropic_accepts, openai_accepts], ids=["anthropic", "openai"])
def test_custom_id_map_is_reversible_and_collision_free(acceptable: Any) -> None:
    mapping = custom_id_map(TRICKY, acceptable)
    assert sorted(mapping.values()) == sorted(TRICKY)  # every record once: reversible
    assert len(mapping) == len(TRICKY)  # no two records share a custom id
    assert all(acceptable(custom) for custom in mapping)
    custom_of = {record: custom for custom, record in mapping.items()}
    assert custom_of["plain"] == "plain"  # acceptable ids are not rewritten
    assert custom_of["bl-plain"] != "bl-plain"  # ... unless they look like a mapped one
    # "a/b" is sent as "bl-YS9i": a record literally named so must not take that from it.
    both = custom_id_map(["a/b", "bl-YS9i"], acceptable)
    assert both["bl-YS9i"] == "a/b" and len(both) == 2
    assert custom_of["bl-YS9i"] != "bl-YS9i"
    long_ids = [c for c, r in mapping.items() if r.startswith("x" * 65)]
    assert len(long_ids) == 2 and all(c.startswith("bl-h-") for c in long_ids)
    assert custom_id_map(TRICKY, acceptable) == mapping  # the same shard maps the same way every time


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=90), unique=True, max_size=30))
def test_custom_id_map_property(record_ids: list[str]) -> None:
    for acceptable in (anthropic_accepts, openai_accepts):
        mapping = custom_id_map(record_ids, acceptable)
        assert sorted(mapping.values()) == sorted(record_ids)
        assert all(acceptable(custom) for custom in mapping)


def test_a_batch_over_the_api_limits_is_refused_before_sending(server: FakeAnthropicBatch,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import batchline.providers.anthropic_batch as module

    monkeypatch.setattr(module, "MAX_BODY_BYTES", 100)
    with pytest.raises(ProviderError, match="shard_size") as info:
        make_provider(server).submit(requests_for("a"), tag="t")
    assert info.value.fatal and server.request_log == []
