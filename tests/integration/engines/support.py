"""Helpers shared by the engine tests (and bench/refill_slots.py): a RequestSource over a
list, the example prompt, and a tiny random Llama with a tokenizer trained on that prompt."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from batchline.engines.base import EngineRequest
from batchline.prompts.render import render, split_template

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "tickets"


def triage_template() -> tuple[str, str]:
    """The example job's prompt, split around its record block."""
    return split_template((EXAMPLES / "triage.prompt").read_text(encoding="utf-8"))


def make_request(record_id: str, prefix: str, text: str, suffix: str = "") -> EngineRequest:
    """A request rendered the way the pipeline renders it: prefix, then the delimited record."""
    return EngineRequest(
        record_id=record_id, prompt=render(prefix, suffix, text), prefix=prefix, text=text
    )


class ListSource:
    """A RequestSource that hands out a fixed list of requests, recording each call."""

    def __init__(self, requests: Iterable[EngineRequest]) -> None:
        self._pending = list(requests)
        self._lock = threading.Lock()
        self.calls: list[tuple[str, int, int]] = []

    def next_batch(self, max_items: int) -> list[EngineRequest]:
        return self._take("next_batch", max_items)

    def poll(self, max_items: int) -> list[EngineRequest]:
        return self._take("poll", max_items)

    def _take(self, kind: str, max_items: int) -> list[EngineRequest]:
        with self._lock:
            batch, self._pending = self._pending[:max_items], self._pending[max_items:]
            self.calls.append((kind, max_items, len(batch)))
            return batch


def save_tiny_llama(path: Path, max_positions: int = 4096, hidden_size: int = 64) -> None:
    """A 2-layer Llama with random weights and a byte-level BPE tokenizer trained on the
    example prompt, saved as a model directory: nothing is downloaded. Its 4 heads are
    hidden_size / 4 wide: vLLM's CPU attention needs 64 (hidden_size 256)."""
    import tokenizers
    import torch
    import transformers as transformers_module

    # The library's stubs lag its API (tokenizer classes): used untyped here.
    transformers: Any = transformers_module
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
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
