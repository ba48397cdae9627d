"""The transformers engine on a tiny Llama with random weights, built inside the test.

Nothing is downloaded: the tokenizer is trained here (byte-level BPE) on the
example prompt's tickets, and the model is a 2-layer Llama initialised at random
(tests/integration/engines/support.py).
Random weights choose random tokens, so only constrained decoding can make the
output schema-valid: that is what these tests check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from batchline.digests import sha256_tree
from batchline.engines import create_engine
from batchline.engines.base import EngineConfig, EngineRequest, plain_chat_prompt
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import (
    EXAMPLES,
    ListSource,
    make_request,
    save_tiny_llama,
    triage_template,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.engine

SCHEMA: dict[str, Any] = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return path, "sha256:" + sha256_tree(path)


def _engine(path: Path, digest: str | None, *, max_tokens: int = 400, temperature: float = 0.0,
            **options: Any) -> Any:
    config = EngineConfig(
        model=ModelSpec(engine="transformers", path=str(path), digest=digest,
                        options={"device": "cpu", **options}),
        decoding=DecodingSpec(temperature=temperature, max_tokens=max_tokens, seed=0),
        output_schema=SCHEMA,
    )
    return create_engine(config)


TICKETS = [
    "laptop charger broken please provide one thanks",
    "please reset my confluence password, account locked",
    "new purchase po dear purchased monitor please log installation",
    "wants to access documents accept or decline request",
    "windows upgrade error hi during upgrading process got error",
]


def test_random_weights_yield_schema_valid_json(tiny_model: tuple[Path, str]) -> None:
    path, digest = tiny_model
    engine = _engine(path, digest, batch_size=3)
    engine.load()
    prefix, suffix = triage_template()
    source = ListSource(make_request(f"t-{i}", prefix, text, suffix) for i, text in enumerate(TICKETS))
    outcomes = list(engine.generate(source))
    engine.close()

    assert sorted(o.record_id for o in outcomes) == [f"t-{i}" for i in range(len(TICKETS))]
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
        assert outcome.output is not None
        jsonschema.validate(json.loads(outcome.output), SCHEMA)
        assert outcome.output_tokens is not None and 0 < outcome.output_tokens <= 400
        assert (outcome.finish_reason, outcome.constrained) == ("stop", True)
    # One blocking take fills the batch; later records are polled in as rows finish, never
    # more than batch_size in flight; the last take, on an empty batch, finds the source dry.
    assert source.calls[0] == ("next_batch", 3, 3)
    assert all(kind == "poll" for kind, _, _ in source.calls[1:-1])
    assert all(asked <= 3 for _, asked, _ in source.calls)
    assert source.calls[-1] == ("next_batch", 3, 0)
    assert sum(n for _, _, n in source.calls) == len(TICKETS)


def test_static_batches_take_batch_size_records_at_a_time(tiny_model: tuple[Path, str]) -> None:
    path, digest = tiny_model
    engine = _engine(path, digest, batch_size=3, refill=False)
    engine.load()
    prefix, suffix = triage_template()
    source = ListSource(make_request(f"t-{i}", prefix, text, suffix) for i, text in enumerate(TICKETS))
    assert len(list(engine.generate(source))) == len(TICKETS)
    assert [n for _, _, n in source.calls] == [3, 2, 0]


def test_token_counts_match_the_tokenizer(tiny_model: tuple[Path, str]) -> None:
    path, digest = tiny_model
    engine = _engine(path, digest, batch_size=2)
    engine.load()
    prefix, suffix = triage_template()
    requests = [make_request(f"t-{i}", prefix, text, suffix) for i, text in enumerate(TICKETS[:2])]
    outcomes = {o.record_id: o for o in engine.generate(ListSource(requests))}
    for request in requests:
        assert outcomes[request.record_id].input_tokens == engine.count_tokens(request.prompt)


def test_batching_does_not_change_greedy_outputs(tiny_model: tuple[Path, str]) -> None:
    # Left padding with explicit positions: a record decodes the same alone or with others.
    path, digest = tiny_model
    prefix, suffix = triage_template()
    outputs = []
    for batch_size in (1, 3):
        engine = _engine(path, digest, batch_size=batch_size)
        engine.load()
        source = ListSource(make_request(f"t-{i}", prefix, t, suffix) for i, t in enumerate(TICKETS[:3]))
        outputs.append({o.record_id: o.output for o in engine.generate(source)})
    assert outputs[0] == outputs[1]


def test_max_tokens_too_small_is_a_per_record_error(tiny_model: tuple[Path, str]) -> None:
    path, digest = tiny_model
    config = EngineConfig(
        model=ModelSpec(engine="transformers", path=str(path), digest=digest, options={"device": "cpu"}),
        decoding=DecodingSpec(temperature=0.0, max_tokens=5, seed=0),
        output_schema=SCHEMA,
    )
    engine = create_engine(config)
    engine.load()
    prefix, suffix = triage_template()
    outcomes = list(engine.generate(ListSource([make_request("t-0", prefix, TICKETS[0], suffix)])))
    assert len(outcomes) == 1
    assert outcomes[0].error_kind == "engine_error"
    assert "max_tokens=5" in (outcomes[0].error or "")
    assert (outcomes[0].finish_reason, outcomes[0].constrained, outcomes[0].output_tokens) == ("length", True, 5)


def test_unconstrained_outcomes_say_so_and_why_they_ended(tiny_model: tuple[Path, str]) -> None:
    path, digest = tiny_model
    engine = _engine(path, digest, max_tokens=7, constrained=False, ignore_eos=True)
    engine.load()
    prefix, suffix = triage_template()
    outcomes = list(engine.generate(ListSource([make_request("t-0", prefix, TICKETS[0], suffix)])))
    assert [(o.error, o.finish_reason, o.constrained, o.output_tokens) for o in outcomes] == [
        (None, "length", False, 7)]


def test_wrong_digest_is_fatal_before_any_record(tiny_model: tuple[Path, str]) -> None:
    path, _ = tiny_model
    engine = _engine(path, "sha256:" + "0" * 64)
    with pytest.raises(EngineFatal, match="digest mismatch"):
        engine.load()


def test_conversations_use_the_tokenizer_chat_template_or_the_plain_form(tiny_model: tuple[Path, str]) -> None:
    path, digest = tiny_model
    engine = _engine(path, digest, batch_size=2)
    engine.load()
    messages = ({"role": "system", "content": "Triage."}, {"role": "user", "content": TICKETS[0]})
    # The trained tokenizer has no template: role-tagged lines.
    assert engine.chat_prompt(messages) == plain_chat_prompt(messages)
    engine.tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}")
    prompt = engine.chat_prompt(messages)
    assert prompt == f"<s>[system] Triage.\n[user] {TICKETS[0]}\n[assistant] "
    [outcome] = list(engine.generate(ListSource([EngineRequest("c", prompt, "", TICKETS[0], messages)])))
    engine.close()
    assert outcome.error is None, outcome.error
    jsonschema.validate(json.loads(outcome.output or ""), SCHEMA)
    # The template wrote the BOS; the tokenizer adds no second one.
    assert outcome.input_tokens == len(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])


# Tickets of very different lengths, so that outputs differ in length too.
MIXED = [TICKETS[0], "printer", "vpn " * 40 + "cannot connect from home since the upgrade", "hi",
         "please add me to the finance share drive and the payroll repository, urgent " * 3]


def _outputs(engine: Any, requests: list[EngineRequest]) -> dict[str, tuple[str | None, int | None]]:
    engine.load()
    outcomes = list(engine.generate(ListSource(requests)))
    assert len(outcomes) == len(requests)
    return {o.record_id: (o.output, o.output_tokens) for o in outcomes}


def _mixed_requests() -> list[EngineRequest]:
    prefix, suffix = triage_template()
    return [make_request(f"m-{i}", prefix, text, suffix) for i, text in enumerate(MIXED)]


def test_prefix_reuse_and_refill_give_the_plain_paths_tokens(tiny_model: tuple[Path, str]) -> None:
    path, digest = tiny_model
    requests = _mixed_requests()
    plain = _engine(path, digest, batch_size=2, prefix_cache=False, refill=False)
    reuse = _engine(path, digest, batch_size=2, refill=False)
    refill = _engine(path, digest, batch_size=2)
    expected = _outputs(plain, requests)
    assert _outputs(reuse, requests) == expected
    assert _outputs(refill, requests) == expected
    assert plain.counts.reused_tokens == 0
    prompt_tokens = sum(plain.count_tokens(r.prompt) for r in requests)
    assert plain.counts.prefill_tokens == prompt_tokens
    # With reuse the prefix is run once and each record runs only its own tokens.
    prefix_tokens = plain.count_tokens(requests[0].prefix)
    assert reuse.counts.reused_tokens >= len(requests) * (prefix_tokens - 1)
    assert reuse.counts.prefill_tokens == prompt_tokens - reuse.counts.reused_tokens + prefix_tokens
    assert refill.counts.reused_tokens == reuse.counts.reused_tokens


def test_a_prompt_that_merges_across_the_prefix_end_reuses_only_what_matches(
        tiny_model: tuple[Path, str]) -> None:
    # "...triage" then "d": the prefix's own last token differs from the prompt's.
    path, digest = tiny_model
    requests = [EngineRequest(f"x-{i}", f"IT service-desk triage{tail}", "IT service-desk triage", tail)
                for i, tail in enumerate(["d ticket: printer", " ticket: printer", "s: laptop"])]
    plain = _engine(path, digest, max_tokens=300, prefix_cache=False, refill=False)
    reuse = _engine(path, digest, max_tokens=300)
    assert _outputs(reuse, requests) == _outputs(plain, requests)
    assert 0 < reuse.counts.reused_tokens < len(requests) * reuse.count_tokens(requests[0].prefix)


def test_refill_spends_fewer_decode_slots_on_finished_rows(tmp_path: Path) -> None:
    # The model holds 96 positions and every record decodes until it reaches them
    # (ignore_eos), so output lengths are the prompts' differences, whatever the weights.
    save_tiny_llama(tmp_path, max_positions=96)
    digest = "sha256:" + sha256_tree(tmp_path)
    tickets = [" ".join(["laptop charger broken"] * n) for n in (1, 5, 2, 3, 5, 1, 2, 4, 4, 1, 2, 3)]
    requests = [make_request(f"s-{i}", "Label the ticket.\n", text) for i, text in enumerate(tickets)]
    options = {"batch_size": 4, "constrained": False, "ignore_eos": True, "max_tokens": 200}
    static = _engine(tmp_path, digest, refill=False, **options)
    refill = _engine(tmp_path, digest, **options)
    outputs = _outputs(static, requests)
    assert _outputs(refill, requests) == outputs
    lengths = [outputs[r.record_id][1] or 0 for r in requests]
    assert lengths == [96 - static.count_tokens(r.prompt) for r in requests]
    assert max(lengths) >= 2 * min(lengths), lengths
    # A record of n tokens takes n - 1 forwards after its prompt's (the first token comes
    # from the prefill). A static batch runs until its longest record ends.
    forwards = [n - 1 for n in lengths]
    batches = [forwards[i:i + 4] for i in range(0, len(forwards), 4)]
    assert static.counts.decode_rows == sum(len(b) * max(b) for b in batches)
    assert static.counts.idle_rows == sum(max(b) - f for b in batches for f in b) > 0
    # Refill (an eighth of 4 rows rounds up to one) runs a finished row once more, fed
    # padding, and then replaces it in the rebuild that admits the next record: at most
    # one slot per record, none for those that finish with no other row live.
    assert refill.counts.decode_rows - refill.counts.idle_rows == sum(forwards)
    assert refill.counts.idle_rows < len(requests)
    assert refill.counts.idle_rows * 4 < static.counts.idle_rows
    assert refill.counts.decode_steps < static.counts.decode_steps


def test_a_failing_record_on_the_refill_path_fails_alone(tiny_model: tuple[Path, str]) -> None:
    path, digest = tiny_model
    requests = _mixed_requests()[:4]
    expected = _outputs(_engine(path, digest, batch_size=2), requests)
    engine = _engine(path, digest, batch_size=2)
    engine.load()
    encode = engine._prompt_ids

    def poisoned(request: EngineRequest) -> Any:
        if request.record_id == "m-2":
            raise RuntimeError("tokenizer broke on this record")
        return encode(request)

    engine._prompt_ids = poisoned
    outcomes = {o.record_id: o for o in engine.generate(ListSource(requests))}
    assert sorted(outcomes) == sorted(expected)
    assert outcomes["m-2"].error_kind == "engine_error"
    assert "tokenizer broke" in (outcomes["m-2"].error or "")
    assert {rid: (o.output, o.output_tokens) for rid, o in outcomes.items() if rid != "m-2"} == {
        rid: out for rid, out in expected.items() if rid != "m-2"}


def test_sampled_decoding_keeps_static_batches(tiny_model: tuple[Path, str]) -> None:
    # A sampled batch draws from one generator seeded per batch: the same batch gives
    # the same samples, with or without the prefix's cache.
    path, digest = tiny_model
    requests = _mixed_requests()[:2]
    first = _engine(path, digest, temperature=0.8, batch_size=2)
    plain = _engine(path, digest, temperature=0.8, batch_size=2, prefix_cache=False)
    assert _outputs(first, requests) == _outputs(plain, requests)
    assert first.counts.admissions == 1 and first.counts.idle_rows > 0


def test_rows_without_a_shared_prefix_decode_beside_rows_with_one(tiny_model: tuple[Path, str]) -> None:
    # A conversation has no shared prefix; in one batch with prefixed records its row
    # gets no reused keys and values, and every record keeps its plain-path tokens.
    path, digest = tiny_model
    messages = ({"role": "system", "content": "Triage."}, {"role": "user", "content": TICKETS[1]})
    chat = EngineRequest("c", plain_chat_prompt(messages), "", TICKETS[1], messages)
    requests = [_mixed_requests()[1], chat, _mixed_requests()[3]]
    plain = _engine(path, digest, max_tokens=300, batch_size=3, prefix_cache=False, refill=False)
    reuse = _engine(path, digest, max_tokens=300, batch_size=3)
    assert _outputs(reuse, requests) == _outputs(plain, requests)
    prefix_tokens = reuse.count_tokens(requests[0].prefix)
    assert 2 * (prefix_tokens - 1) <= reuse.counts.reused_tokens <= 2 * prefix_tokens
