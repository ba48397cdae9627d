"""Hosted batch providers: one module per API, imported only when a route uses it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchline.providers.base import BatchProvider, ProviderError
from batchline.spec import DecodingSpec, ProviderSpec

__all__ = ["BatchProvider", "ProviderError", "open_provider"]


def open_provider(spec: ProviderSpec, decoding: DecodingSpec, output_schema: Mapping[str, Any],
                  job_name: str) -> BatchProvider:
    """The provider for `spec.api`. Raises ProviderError (fatal) when the API is unknown,
    httpx is missing, or the API key is not set."""
    try:
        if spec.api == "openai":
            from batchline.providers.openai_batch import OpenAIBatchProvider

            return OpenAIBatchProvider(spec, decoding, output_schema, job_name)
        if spec.api == "anthropic":
            from batchline.providers.anthropic_batch import AnthropicBatchProvider

            return AnthropicBatchProvider(spec, decoding, output_schema, job_name)
    except ImportError as exc:
        raise ProviderError(f"route {spec.route!r} needs httpx (install batchline's 'openai' extra): {exc}",
                            fatal=True) from None
    raise ProviderError(f"route {spec.route!r}: unknown provider api {spec.api!r}", fatal=True)
