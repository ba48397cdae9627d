"""The optional decoding knobs as engines with their own decoding loop apply them.

Penalties follow vLLM's and the OpenAI API's definitions, so a job means the
same on every engine: ``repetition_penalty`` (Keskar et al. 2019, as
transformers' ``RepetitionPenaltyLogitsProcessor``) divides a positive logit
and multiplies a negative one by the penalty for every token already in the
prompt or the output; ``frequency_penalty`` subtracts the penalty times the
token's count in the output, ``presence_penalty`` the penalty once a token is
in the output. Stop sequences end the output before the first of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from batchline.spec import DecodingSpec

# Tokens decoded again to look for a stop sequence: at least this many, more for longer stops.
MIN_STOP_WINDOW = 8


class TokenPenalties:
    """One record's penalty state: the tokens seen so far and their counts in the output."""

    def __init__(self, decoding: DecodingSpec, prompt: Sequence[int]) -> None:
        self.repetition = decoding.repetition_penalty or 1.0  # 1: none
        self.frequency = decoding.frequency_penalty or 0.0
        self.presence = decoding.presence_penalty or 0.0
        self.active = self.repetition != 1.0 or bool(self.frequency) or bool(self.presence)
        self.seen: set[int] = set(prompt) if self.repetition != 1.0 else set()
        self.counts: Counter[int] = Counter()
        self._repeated: list[int] | None = None  # sorted(seen), kept until a new token is seen

    def add(self, tokens: Iterable[int]) -> None:
        if not self.active:
            return
        tokens = list(tokens)
        self.counts.update(tokens)
        if self.repetition != 1.0 and not self.seen.issuperset(tokens):
            self.seen.update(tokens)
            self._repeated = None

    def repeated(self) -> list[int]:
        """The tokens the repetition penalty applies to, when there is one."""
        if self._repeated is None:
            self._repeated = sorted(self.seen)
        return self._repeated

    def subtracted(self) -> tuple[list[int], list[float]]:
        """The output's tokens and what the frequency and presence penalties take from each."""
        if not (self.frequency or self.presence):
            return [], []
        tokens = sorted(self.counts)
        return tokens, [self.frequency * self.counts[t] + self.presence for t in tokens]

    def apply(self, logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The logits with the penalties applied (a copy; the input is left as it is)."""
        if not self.active:
            return logits
        out = np.array(logits, dtype=np.float32, copy=True)
        repeated = np.asarray(self.repeated(), dtype=np.int64)
        if len(repeated):
            values = out[repeated]
            out[repeated] = np.where(values > 0, values / self.repetition, values * self.repetition)
        tokens, amounts = self.subtracted()
        if tokens:
            out[np.asarray(tokens, dtype=np.int64)] -= np.asarray(amounts, dtype=np.float32)
        return out


def stop_window(stops: Sequence[str]) -> int:
    """How many of the output's last tokens to decode to see any of `stops` complete."""
    return max([MIN_STOP_WINDOW, *(len(s) + 1 for s in stops)])


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text before the first stop sequence in it, and whether there was one."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(found)], True) if found else (text, False)
