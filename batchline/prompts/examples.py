"""Retrieved examples: for each record, the labelled examples whose text is nearest to it.

A small model answers far better when shown tickets like the one in front of it
with the labels people gave them than from a fixed list of examples. The set is
part of the job (its items are stored in the spec and their digest is part of
the version), and the choice is deterministic: Okapi BM25 over lower-cased word
tokens, ties broken by the examples' order, so a retried record sees the same
prompt. The examples go after the shared instruction prefix, so the prefix stays
identical for every record and an engine still computes it once.

An example never answers for itself: one with the record's id or the record's
exact text is passed over, so a labelled file that overlaps the input, or the
records a run is graded on, cannot hand the model its answer.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from batchline.prompts.render import CLOSE, OPEN, neutralise

_WORD = re.compile(r"\w+", re.UNICODE)
# A long neighbour adds more prompt tokens than signal, and every prompt token of an
# example is computed for each record: an example shows its first characters only.
DEFAULT_EXAMPLE_CHARS = 150
# Okapi BM25's usual constants.
_K1 = 1.2
_B = 0.75


@dataclass(frozen=True)
class Example:
    id: str
    text: str
    label: str


def examples_digest(items: Sequence[Example]) -> str:
    material = json.dumps([[e.id, e.text, e.label] for e in items], ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(material.encode()).hexdigest()


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class ExampleIndex:
    """The k examples nearest a record's text, by BM25 over an inverted index."""

    def __init__(self, items: Sequence[Example], k: int, max_chars: int = DEFAULT_EXAMPLE_CHARS) -> None:
        self.items = tuple(items)
        self.k = k
        self.max_chars = max_chars
        words = [_words(e.text) for e in self.items]
        average = (sum(map(len, words)) / len(words)) if words else 1.0
        # Each example's BM25 weight for each of its words, computed once: a query only
        # adds idf times weight over the postings of its words.
        postings: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
        for i, ws in enumerate(words):
            norm = _K1 * (1 - _B + _B * len(ws) / average)
            for word, count in collections.Counter(ws).items():
                postings[word].append((i, count * (_K1 + 1) / (count + norm)))
        n = len(self.items)
        self._postings = dict(postings)
        self._idf = {w: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for w, p in postings.items()}

    def nearest(self, record_id: str, text: str) -> list[Example]:
        scores: dict[int, float] = collections.defaultdict(float)
        for word in set(_words(text)):
            idf = self._idf.get(word)
            if idf is None:
                continue
            for i, weight in self._postings[word]:
                scores[i] += idf * weight
        ranked = sorted(scores, key=lambda i: (-scores[i], i))
        chosen: list[Example] = []
        for i in ranked:
            e = self.items[i]
            if e.id == record_id or e.text == text:
                continue
            chosen.append(e)
            if len(chosen) == self.k:
                break
        return chosen

    def render(self, record_id: str, text: str, answer_field: str) -> str:
        """The nearest examples as answered records, in the prompt's own record blocks,
        the nearest last (just before the record)."""
        return "".join(f"{OPEN}\n{neutralise(e.text[:self.max_chars])}\n{CLOSE}\n"
                       f"{json.dumps({answer_field: e.label}, ensure_ascii=False)}\n\n"
                       for e in reversed(self.nearest(record_id, text)))
