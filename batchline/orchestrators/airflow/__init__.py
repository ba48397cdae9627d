"""The Airflow provider: `BatchlineHook` and the `batchline` connection type, the deferrable
`BatchlineRunOperator`, and its `BatchlineVersionTrigger`. Airflow finds it through the
`apache_airflow_provider` entry point, which names `get_provider_info`."""

from __future__ import annotations

from typing import Any

INTEGRATION = "batchline"
HOOKS = "batchline.orchestrators.airflow.hooks"
OPERATORS = "batchline.orchestrators.airflow.operators"
TRIGGERS = "batchline.orchestrators.airflow.triggers"


def get_provider_info() -> dict[str, Any]:
    """What Airflow's providers manager reads of this provider (its provider_info schema)."""
    from batchline.version import __version__

    return {
        "package-name": "batchline",
        "name": "batchline",
        "description": "Offline LLM batch jobs on a fleet that can be taken away: planned, launched once, "
                       "waited for without a worker slot, validated and published.",
        "versions": [__version__],
        "integrations": [{"integration-name": INTEGRATION, "tags": ["software"],
                          "external-doc-url": "https://batchline.dev/scheduling/"}],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": [HOOKS]}],
        "operators": [{"integration-name": INTEGRATION, "python-modules": [OPERATORS]}],
        "triggers": [{"integration-name": INTEGRATION, "python-modules": [TRIGGERS]}],
        "connection-types": [{"hook-class-name": f"{HOOKS}.BatchlineHook", "connection-type": "batchline"}],
    }
