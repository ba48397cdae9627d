"""The decoding knobs on the transformers engine, with the tiny random Llama of
test_transformers_engine.py: penalties as transformers' own processor computes them,
and stop sequences that end and cut an output."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from batchline.digests import sha256_tree
from batchline.engines import create_engine
from batchline.engines.base import EngineConfig
from batchline.engines.decoding import TokenPenalties
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import (
    ListSource,
    make_request,
    save_tiny_llama,
    triage_template,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.engine

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
TICKET = "laptop charger broken please provide one thanks"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return path, "sha256:" + sha256_tree(path)


def _run(tiny_model: tuple[Path, str], max_tokens: int = 40, **knobs: Any) -> tuple[Any, list[int]]:
    """The outcome and every token the engine generated."""
    path, digest = tiny_model
    engine = create_engine(EngineConfig(
        model=ModelSpec(engine="transformers", path=str(path), digest=digest,
                        options={"device": "cpu", "constrained": False, "ignore_eos": True}),
        decoding=DecodingSpec(temperature=0.0, max_tokens=max_tokens, seed=0, **knobs),
        output_schema=SCHEMA,
    ))
    engine.load()
    generated: list[list[int]] = []
    outcome_of = engine._outcome

    def recording(row: Any) -> Any:
        generated.append(list(row.out))
        return outcome_of(row)

    engine._outcome = recording
    prefix, suffix = triage_template()
    outcome = next(iter(engine.generate(ListSource([make_request("t", prefix, TICKET, suffix)]))))
    engine.close()
    return outcome, generated[-1]


def test_the_repetition_penalty_is_what_transformers_own_processor_computes(tiny_model: tuple[Path, str]) -> None:
    from batchline.engines.transformers_engine import _Row

    path, digest = tiny_model
    engine = create_engine(EngineConfig(model=ModelSpec(engine="transformers", path=str(path), digest=digest,
                                                        options={"device": "cpu"}),
                                        decoding=DecodingSpec(repetition_penalty=1.7), output_schema=SCHEMA))
    engine.load()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn((2, engine._vocab), generator=generator)
    prompt, out = [5, 9, 9, 40], [9, 77, 3]
    row = _Row(make_request("r", "", "x"), prompt, None, 10, TokenPenalties(engine.config.decoding, prompt))
    row.penalties.add(out)
    ours = engine._penalised(logits, [row, row], [True, False])
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=1.7)
    theirs = processor(torch.tensor([prompt + out]), logits[:1].clone())
    assert torch.allclose(ours[0], theirs[0])
    assert torch.equal(ours[1], logits[1])  # a finished row is left alone


def test_penalties_break_a_repeating_output(tiny_model: tuple[Path, str]) -> None:
    plain, plain_tokens = _run(tiny_model)
    penalised, penalised_tokens = _run(tiny_model, repetition_penalty=3.0, frequency_penalty=2.0)
    assert plain.error is None and penalised.error is None
    most = Counter(plain_tokens).most_common(1)[0][1]
    assert most >= 4, plain.output  # random weights loop: the case the penalties are for
    assert Counter(penalised_tokens).most_common(1)[0][1] < most


def test_a_stop_sequence_ends_the_output_before_it(tiny_model: tuple[Path, str]) -> None:
    plain, _ = _run(tiny_model)
    text = plain.output or ""
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    stopped, _ = _run(tiny_model, stop=(stop,))
    assert stopped.error is None
    assert stopped.output == text[:text.find(stop)].strip()
    assert stopped.finish_reason == "stop"
    assert stopped.output_tokens < plain.output_tokens
