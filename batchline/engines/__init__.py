"""Engine registry: each engine lives in its own module, imported only when used."""

from __future__ import annotations

import importlib

from batchline.engines.base import Engine, EngineConfig
from batchline.errors import EngineFatal

_ENGINES = {
    "synthetic": "batchline.engines.synthetic:SyntheticEngine",
    "llamacpp": "batchline.engines.llamacpp:LlamaCppEngine",
    "transformers": "batchline.engines.transformers_engine:TransformersEngine",
    "vllm": "batchline.engines.vllm_engine:VllmEngine",
    "openai": "batchline.engines.openai_engine:OpenAIEngine",
    "embedding": "batchline.engines.embedding:EmbeddingEngine",
}


def create_engine(config: EngineConfig) -> Engine:
    target = _ENGINES.get(config.model.engine)
    if target is None:
        raise EngineFatal(f"unknown engine {config.model.engine!r}")
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineFatal(
            f"engine {config.model.engine!r} is not available: {exc} "
            f"(install batchline's '{config.model.engine}' extra)"
        ) from None
    engine: Engine = getattr(module, class_name)(config)
    return engine
