"""How batchline reaches object storage: one configuration for every client.

Every client that touches the lake (the object store's for inputs, exports and
weights; a table format's; DuckDB reading tables back) is configured from one
`LakeSettings`, built by `lake_settings()` from two places:

- the spec's `input.storage` mapping, which may hold only settings that are no
  secret: `endpoint` (an S3-compatible endpoint such as MinIO, R2 or a test
  stand-in, or a GCS base URL), `region`, `timeout_seconds` (a request that
  sends nothing for this long is retried) and `unavailable_seconds` (how long
  reads keep retrying before a worker gives its lease back). It is stored with
  the job, so workers on other machines use the same settings;
- the environment, for anything the spec leaves out: `AWS_ENDPOINT_URL_S3`,
  `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_DEFAULT_REGION`, and for GCS
  `STORAGE_EMULATOR_HOST` (an emulator, which takes no credentials).

Credentials are never part of either: each client reads them from the
environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
`GOOGLE_APPLICATION_CREDENTIALS`, ...) or the machine's identity (instance
role, workload identity), so nothing that holds a key is written into a spec
or a store. A spec that tries is refused with one line naming the field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from batchline.errors import SpecError

DEFAULT_TIMEOUT_SECONDS = 30.0
DEFAULT_UNAVAILABLE_SECONDS = 300.0
_SECONDS = {"type": "number", "exclusiveMinimum": 0}
# input.storage's fields, with the JSON Schema of each (the spec's schema is made from these).
STORAGE_FIELDS: dict[str, dict[str, Any]] = {
    "endpoint": {"type": "string", "pattern": "^https?://", "description": "An S3-compatible endpoint, or a GCS base URL"},
    "region": {"type": "string", "minLength": 1, "description": "The object store's region"},
    "timeout_seconds": {**_SECONDS, "description": "A request that sends nothing for this long is retried"},
    "unavailable_seconds": {**_SECONDS, "description": "How long reads keep retrying before a worker gives its lease back"},
}
STORAGE_KEYS = tuple(STORAGE_FIELDS)
# Words in a key that name a credential; such a key is refused with a pointer to the environment.
_SECRET_WORDS = re.compile(r"secret|password|passwd|token|credential|access_key|private|session|key_id|_key$|^key$",
                           re.IGNORECASE)


@dataclass(frozen=True)
class LakeSettings:
    """Where the object store is and how patient to be with it; never a credential."""

    s3_endpoint: str | None = None  # None: AWS's own endpoint for the region
    region: str | None = None
    gcs_endpoint: str | None = None  # None: Google's own; an emulator's base URL in tests
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    unavailable_seconds: float = DEFAULT_UNAVAILABLE_SECONDS

    def obstore_kwargs(self, scheme: str) -> dict[str, Any]:
        """Keyword arguments for `obstore.store.S3Store(bucket, **kw)` or `GCSStore(bucket, **kw)`.

        obstore's own retries are off: batchline retries (with backoff and jitter)
        up to `unavailable_seconds` itself, so the bound is one number a test can set.
        """
        endpoint = self.s3_endpoint if scheme == "s3" else self.gcs_endpoint
        client: dict[str, Any] = {
            "connect_timeout": f"{max(1, round(self.timeout_seconds * 1000))}ms",
            "read_timeout": f"{max(1, round(self.timeout_seconds * 1000))}ms",
            # A whole object streams for as long as it takes; read_timeout catches a stall.
            "timeout": "24h",
        }
        if endpoint and endpoint.startswith("http://"):
            client["allow_http"] = True
        config: dict[str, Any] = {}
        if scheme == "s3":
            if endpoint:
                config["endpoint"] = endpoint
            if self.region:
                config["region"] = self.region
        elif endpoint:
            config["base_url"] = endpoint
            # An emulator answers without credentials; Google's own endpoint never gets here unsigned.
            config["skip_signature"] = True
        return {"config": config, "client_options": client, "retry_config": {"max_retries": 0}}

    def object_store_options(self, scheme: str) -> dict[str, str]:
        """The same settings as the `storage_options` of the readers built on Rust's
        object_store (Lance, Delta): credentials stay in the environment, which they read
        themselves."""
        out: dict[str, str] = {}
        if scheme == "s3":
            if self.s3_endpoint:
                out["aws_endpoint"] = self.s3_endpoint
                if self.s3_endpoint.startswith("http://"):
                    out["allow_http"] = "true"
            if self.region:
                out["aws_region"] = self.region
        elif scheme == "gs" and self.gcs_endpoint:
            # As obstore_kwargs: a GCS endpoint of its own is an emulator, which answers unsigned.
            out["google_base_url"] = self.gcs_endpoint
            out["google_skip_signature"] = "true"
            if self.gcs_endpoint.startswith("http://"):
                out["allow_http"] = "true"
        return out

    def duckdb_settings(self) -> dict[str, str]:
        """The same settings as DuckDB httpfs `SET` options (credentials stay in the environment)."""
        out: dict[str, str] = {}
        if self.s3_endpoint:
            parts = urlsplit(self.s3_endpoint)
            out["s3_endpoint"] = parts.netloc or parts.path
            out["s3_use_ssl"] = "false" if parts.scheme == "http" else "true"
            out["s3_url_style"] = "path"
        if self.region:
            out["s3_region"] = self.region
        return out


def lake_settings(options: Mapping[str, Any] | None = None,
                  env: Mapping[str, str] | None = None) -> LakeSettings:
    """The settings for a job: its spec's `input.storage` first, then the environment."""
    env = os.environ if env is None else env
    opts = dict(options or {})
    endpoint = opts.get("endpoint")
    return LakeSettings(
        s3_endpoint=endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
        region=opts.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
        gcs_endpoint=endpoint or _emulator(env.get("STORAGE_EMULATOR_HOST")),
        timeout_seconds=float(opts.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)),
        unavailable_seconds=float(opts.get("unavailable_seconds", DEFAULT_UNAVAILABLE_SECONDS)),
    )


def _emulator(host: str | None) -> str | None:
    if not host:
        return None
    return host if "://" in host else f"http://{host}"


def check_storage_options(raw: Any, where: str, name: str = "input.storage") -> dict[str, Any]:
    """`input.storage` (or a region's `storage`, `name`) as the spec gives it: only known keys
    that hold no secret."""
    field = f"{where}: {name}"
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError(f"{field}: must be a mapping")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{field}.{key}"
        if _SECRET_WORDS.search(str(key)):
            raise SpecError(f"{name}: credentials never go in a spec (it is stored with the job); give them "
                            "to each machine through its environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                            "GOOGLE_APPLICATION_CREDENTIALS) or its role")
        if key not in STORAGE_KEYS:
            raise SpecError(f"{name}: unknown field (allowed: {', '.join(STORAGE_KEYS)})")
        if key in ("endpoint", "region"):
            if not isinstance(value, str) or not value:
                raise SpecError(f"{name}: must be a non-empty string")
            if key == "endpoint":
                parts = urlsplit(value)
                if parts.scheme not in ("http", "https") or not parts.netloc:
                    raise SpecError(f"{name}: {value!r} must be an http:// or https:// URL")
                if parts.username or parts.password or parts.query:
                    raise SpecError(f"{name}: an endpoint with a user, password or query string may hold a "
                                    "credential, and the spec is stored; give credentials through the environment")
        else:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise SpecError(f"{name}: must be a positive number of seconds, not {value!r}")
        out[key] = value
    return out
