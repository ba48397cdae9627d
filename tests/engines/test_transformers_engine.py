"""The transformers engine on a tiny Llama with random weights, built inside the test.

Nothing is downloaded: the tokenizer is trained here (byte-level BPE) on the
example prompt's tickets, and the model is a 2-layer Llama initialised at random.
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
from tests.engines.support import EXAMPLES, ListSource, make_request, triage_template

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.engine

SCHEMA: dict[str, Any] = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    corpus = (EXAMPLES / "triage.prompt").read_text(encoding="utf-8").splitlines()
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, "sha256:" + sha256_tree(path)


def _engine(path: Path, digest: str | None, **options: Any) -> Any:
    config = EngineConfig(
        model=ModelSpec(engine="transformers", path=str(path), digest=digest,
                        options={"device": "cpu", **options}),
        decoding=DecodingSpec(temperature=0.0, max_tokens=400, seed=0),
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
    # Batches of at most batch_size were taken from the source until it ran dry.
    assert [n for kind, _, n in source.calls] == [3, 2, 0]


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
