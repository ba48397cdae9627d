"""OpenLineage events of a job's runs: what every published row came from.

The store writes each state change of a version into its lineage outbox, in the
transaction that makes the change (`batchline.store.lineage`); any batchline process of
the job drains the outbox through the `openlineage-python` client, configured the
standard way (`openlineage.yml`, `OPENLINEAGE_URL`, `OPENLINEAGE__...` variables). With
nothing configured, nothing is drained and nothing is imported: lineage costs a few rows
per version in the store.

- `config`: whether lineage is on here, and a malformed configuration refused in one line;
- `events`: the OpenLineage event of an outbox row (run ids, datasets, facets);
- `drain`: sending, marking, retrying, in the caller's thread or beside it.
"""

from batchline.lineage.config import LineageConfig, LineageConfigError, lineage_config
from batchline.lineage.drain import Drainer, drain_now

__all__ = ["Drainer", "LineageConfig", "LineageConfigError", "drain_now", "lineage_config"]
