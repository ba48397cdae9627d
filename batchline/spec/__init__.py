"""The job spec: YAML validated into typed objects, and the job version hash (I2).

The names other modules use are taken from here; where each is defined is this
package's own business.
"""

from batchline.spec.model import (
    LOCAL_ROUTE,
    OBJECT_SCHEMES,
    OPENAI_BATCH,
    PENALTY_DEFAULTS,
    STORE_CATALOG,
    ChatRules,
    DecodingSpec,
    EvalSpec,
    InputSpec,
    JobSpec,
    ModelSpec,
    ProviderSpec,
    RoutingSpec,
    ShardSpec,
    TableRef,
    canonical_json,
    load_spec,
    parse_spec,
    spec_from_store,
    stop_sequences,
    stored_spec,
)

__all__ = ["LOCAL_ROUTE", "OBJECT_SCHEMES", "OPENAI_BATCH", "PENALTY_DEFAULTS", "STORE_CATALOG", "ChatRules",
           "DecodingSpec", "EvalSpec", "InputSpec", "JobSpec", "ModelSpec", "ProviderSpec", "RoutingSpec", "ShardSpec", "TableRef",
           "canonical_json", "load_spec", "parse_spec", "spec_from_store", "stop_sequences", "stored_spec"]
