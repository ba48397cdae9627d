"""The job spec: its typed model and version hash (`model`), its parser (`parse`), the
typed readers plug-ins parse their own sections with (`reader`), and its JSON Schema
(`schema`). Other modules take the names they use from here."""

from batchline.spec.model import (
    LOCAL_ROUTE,
    OPENAI_BATCH,
    PENALTY_DEFAULTS,
    ROWS,
    STORED,
    ChatRules,
    DecodingSpec,
    InputSpec,
    JobSpec,
    ModelSpec,
    ProviderSpec,
    ReproduceSpec,
    RoutingSpec,
    ShardSpec,
    canonical_json,
)
from batchline.spec.parse import (
    JobVersion,
    check_abort_rate,
    load_spec,
    parse_spec,
    spec_from_store,
    stop_sequences,
    stored_spec,
)

__all__ = [
    "LOCAL_ROUTE",
    "OPENAI_BATCH",
    "PENALTY_DEFAULTS",
    "ROWS",
    "STORED",
    "ChatRules",
    "DecodingSpec",
    "InputSpec",
    "JobSpec",
    "JobVersion",
    "ModelSpec",
    "ProviderSpec",
    "ReproduceSpec",
    "RoutingSpec",
    "ShardSpec",
    "canonical_json",
    "check_abort_rate",
    "load_spec",
    "parse_spec",
    "spec_from_store",
    "stop_sequences",
    "stored_spec",
]
