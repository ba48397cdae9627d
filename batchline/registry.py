"""The extension points: one table of engines, one of hosted batch providers.

The job spec's validation, the job version and the loaders all read these
tables, so adding an engine or a provider is one new module and one line here.
A `revision` is part of every job version that uses the extension: bump it when
a change to the module's code defaults (prompt formatting, stop strings,
calibration, how requests are built) can change a result, so the change makes
new versions instead of mixing answers inside an old one (I2).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Extension:
    name: str
    target: str  # "module:attribute", imported only when a job uses it
    revision: int
    extra: str  # the pip extra that installs what it needs
    # The same input and decoding at temperature 0 give the same output (a local engine),
    # so a generation cut off at max_tokens would be cut off again: it is not retried.
    deterministic: bool = True

    def load(self) -> Any:
        module_name, attribute = self.target.split(":")
        return getattr(importlib.import_module(module_name), attribute)


def _table(*extensions: Extension) -> Mapping[str, Extension]:
    return {e.name: e for e in extensions}


ENGINES = _table(
    Extension("llamacpp", "batchline.engines.llamacpp:LlamaCppEngine", 1, "llamacpp"),
    Extension("transformers", "batchline.engines.transformers_engine:TransformersEngine", 1, "transformers"),
    Extension("vllm", "batchline.engines.vllm_engine:VllmEngine", 1, "vllm"),
    # A server of any make, hosted or not: its answers at temperature 0 may differ per call.
    Extension("openai", "batchline.engines.openai_engine:OpenAIEngine", 1, "openai", deterministic=False),
    Extension("embedding", "batchline.engines.embedding:EmbeddingEngine", 1, "embedding"),
    Extension("synthetic", "batchline.engines.synthetic:SyntheticEngine", 1, "dev"),
)

PROVIDERS = _table(
    Extension("openai", "batchline.providers.openai_batch:OpenAIBatchProvider", 1, "openai"),
    Extension("anthropic", "batchline.providers.anthropic_batch:AnthropicBatchProvider", 1, "openai"),
)
