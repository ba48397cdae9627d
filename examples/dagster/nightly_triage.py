"""The nightly ticket triage as Dagster assets: the incremental triage job, then the
embedding job over its summaries (published into a LanceDB index), each asset's checks the
checks of its job's gate. The store's URL comes from the environment (BATCHLINE_STORE),
never from this file:

    BATCHLINE_STORE=postgresql://... dagster dev -f examples/dagster/nightly_triage.py
"""

from __future__ import annotations

from pathlib import Path

from dagster import Definitions, EnvVar

from batchline.orchestrators.dagster import BatchlineResource, batchline_asset

SPECS = Path(__file__).resolve().parents[1] / "nightly"

triage = batchline_asset(SPECS / "triage.yaml", workers=2, deadline="6h", group_name="tickets")
summaries = batchline_asset(SPECS / "summaries.yaml", deps=[triage], group_name="tickets")

defs = Definitions(assets=[triage, summaries],
                   resources={"batchline": BatchlineResource(store_url=EnvVar("BATCHLINE_STORE"))})
