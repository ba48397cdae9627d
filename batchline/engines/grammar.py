"""Schema-constrained decoding shared by the local engines, through llguidance.

llguidance computes, for a JSON Schema, which tokens may come next, and which
tokens are forced (fast-forward). It needs neither torch nor a GPU, so the
embedded llama.cpp engine can use it as well as the transformers engine; a
token mask costs well under a millisecond even for Gemma's 262k vocabulary,
where llama.cpp's own GBNF sampling quarters the decoding speed.

Everything here imports llguidance lazily: the core of batchline never needs it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from batchline.errors import EngineFatal

# One compact layout for every output: no free whitespace (with random or weak
# weights free whitespace can run until max_tokens) and the separators the
# prompts' examples use. A schema can still override these with "x-guidance".
JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise EngineFatal(
            "constrained decoding needs llguidance (pip install llguidance), "
            "or set model.options.constrained: false"
        ) from None
    return llguidance


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """The llguidance grammar for a JSON Schema; raises EngineFatal if it cannot be compiled."""
    llg = import_llguidance()
    try:
        grammar: str = llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_LAYOUT
        )
    except ValueError as exc:
        raise EngineFatal(f"output schema cannot be turned into a grammar: {exc}") from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise EngineFatal(f"output schema cannot be turned into a grammar: {messages[0]}")
    return grammar


class GrammarSession:
    """One record's matcher plus the buffers for its token masks."""

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int) -> None:
        llg = import_llguidance()
        self.matcher = llg.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise EngineFatal(f"grammar rejected: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self._bits = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)

    def allowed(self) -> npt.NDArray[np.bool_]:
        """A boolean mask over the vocabulary of the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def accepts(self, token: int) -> bool:
        return int(self.matcher.validate_tokens([token])) == 1

    def consume(self, tokens: list[int]) -> None:
        if not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"grammar refused tokens {tokens}: {self.matcher.get_error()}")

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (e.g. a key and its quotes), to be fed in one batch."""
        return list(self.matcher.compute_ff_tokens())

    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    def complete(self) -> bool:
        return bool(self.matcher.is_accepting())


def pick_token(
    logits: npt.NDArray[np.float32],
    session: GrammarSession | None,
    temperature: float,
    top_p: float,
    rng: np.random.Generator,
) -> tuple[int, bool]:
    """Greedy or sampled choice of the next token, restricted to what the grammar allows.

    The unrestricted choice is tried first and the mask computed only when the
    grammar refuses it: a model prompted with examples mostly proposes valid
    tokens, so most steps cost one cheap check. For sampling this is exact:
    drawing from p and redrawing from the masked, renormalised p when refused
    gives every allowed token probability p(t)/Z, the masked distribution.
    Returns the token and whether the mask was needed.
    """
    token = _choose(logits, temperature, top_p, rng)
    if session is None or session.accepts(token):
        return token, False
    masked = np.where(session.allowed(), logits, np.float32(-np.inf))
    if not np.isfinite(masked).any():
        raise RuntimeError("the grammar allows no token here")
    return _choose(masked, temperature, top_p, rng), True


def _choose(
    logits: npt.NDArray[np.float32], temperature: float, top_p: float, rng: np.random.Generator
) -> int:
    if temperature <= 0.0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    scaled -= scaled.max()
    probs = np.exp(scaled)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    return int(rng.choice(len(probs), p=probs))


def record_rng(seed: int, record_id: str) -> np.random.Generator:
    """A generator per record, so a sampled output does not depend on batch-mates or order."""
    material = np.frombuffer(record_id.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
    return np.random.default_rng([seed, *material.tolist()])
