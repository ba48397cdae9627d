"""Hosted batch providers: one module per API, registered in `batchline.registry.PROVIDERS`,
imported only when a route uses it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchline.providers.base import BatchProvider, ProviderError
from batchline.registry import PROVIDERS
from batchline.spec import DecodingSpec, ProviderSpec

__all__ = ["BatchProvider", "ProviderError", "open_provider"]


def open_provider(spec: ProviderSpec, decoding: DecodingSpec, output_schema: Mapping[str, Any],
                  job_name: str) -> BatchProvider:
    """The provider for `spec.api`. Raises ProviderError (fatal) when the API is unknown,
    httpx is missing, or the API key is not set."""
    entry = PROVIDERS.get(spec.api)
    if entry is None:
        raise ProviderError(f"route {spec.route!r}: unknown provider api {spec.api!r}", fatal=True)
    try:
        provider_class = entry.load()
    except ImportError as exc:
        raise ProviderError(f"route {spec.route!r} needs httpx (install batchline's '{entry.extra}' extra): {exc}",
                            fatal=True) from None
    provider: BatchProvider = provider_class(spec, decoding, output_schema, job_name)
    return provider
