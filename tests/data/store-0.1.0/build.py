"""Writes store.db and expected.json: a store written by batchline 0.1.0, kept as it was.

Run once, by that release (`python tests/data/store-0.1.0/build.py`), and never again: the
point of the fixture is that it was written by old code. tests/integration/test_old_store.py
opens a copy with today's code and checks that its stored specs, versions, publications
and history read back as expected.json says they read when they were written.

What is in it: every kind of input the release could plan (local JSONL, CSV and Parquet,
objects in S3, an Iceberg table's snapshot, OpenAI batch lines), specs that use most
optional fields (retrieved examples, decoding knobs, ids from content, an ACL default,
routing to hosted providers, evaluation, a deadline, retention), an incremental version
over a published base, and one name published twice into an Iceberg table and rolled
back once, so its publications carry a target's state under its key.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

PINNED = ROOT / "tests" / "data" / "pinned"
SCHEMA = json.loads((PINNED / "triage.schema.json").read_text())


def write(folder: Path, name: str, spec: dict[str, Any]) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def base(name: str, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "input": {"path": "tickets.jsonl", "acl_field": "acl"},
        "model": {"engine": "synthetic", "options": {"seconds_per_record": 0}},
        "prompt": {"text": "Classify the ticket.\n", "version": "v1"},
        "output": {"schema": "triage.schema.json", "label_field": "category"},
        "shards": {"size": 10, "lease_seconds": 30, "renew_seconds": 1},
    }
    spec.update(extra)
    return spec


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from batchline.catalogs import open_catalog

    import batchline
    from batchline.spec import TableRef, stored_spec
    from examples.s3_standin import S3StandIn

    out_db = HERE / "store.db"
    out_db.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="batchline-store-0.1.0-"))
    for f in PINNED.iterdir():
        shutil.copy(f, work / f.name)
    labelled = (ROOT / "examples" / "tickets" / "labelled.jsonl").read_text().splitlines(keepends=True)
    (work / "labelled.jsonl").write_text("".join(labelled[:30]))
    url = f"sqlite:///{out_db}"
    jobs = batchline.Jobs(url)
    quiet = {"log": lambda _m: None}

    # One name published twice into an Iceberg table (the store's own catalog), rolled back once.
    table = {"catalog": "store", "name": "lake.results", "warehouse": str(work / "warehouse")}
    first = write(work, "triage-v1", base("legacy-triage", output={**base("x")["output"], "table": table}))
    second = write(work, "triage-v2", base("legacy-triage", output={**base("x")["output"], "table": table},
                                           prompt={"text": "Classify the ticket, briefly.\n", "version": "v2"}))
    v1 = jobs.run(first, workers=1, **quiet).version
    v2 = jobs.run(second, workers=1, **quiet).version
    for version in (v1, v2):
        jobs.validate(version)
        jobs.publish(version)
    jobs.rollback("legacy-triage", reason="the v2 prompt was worse")
    # An incremental version over the published one: every record carried.
    jobs.run(write(work, "triage-incremental", base("legacy-triage", output={**base("x")["output"], "table": table},
                                                      base="published")), workers=1, **quiet)

    csv = jobs.run(write(work, "csv", base("legacy-csv", input={"path": "tickets.csv", "acl_field": "acl"})),
                   workers=1, **quiet).version
    jobs.validate(csv)
    jobs.publish(csv)
    jobs.run(write(work, "parquet", base("legacy-parquet", input={"path": "tickets.parquet", "acl_field": "acl",
                                                                  "max_input_tokens": 512})), workers=1, **quiet)

    # Most optional fields, planned only.
    jobs.plan(write(work, "rich", base(
        "legacy-rich",
        input={"path": "tickets.jsonl", "text_field": "text", "acl_field": "acl", "acl_missing": ["restricted"],
               "ids": "content", "max_input_tokens": 256, "max_bytes_per_token": 8},
        model={"engine": "synthetic", "options": {"seconds_per_record": 0, "error_on": ["x"]}},
        prompt={"file": "triage.prompt", "version": "v3", "examples": {"file": "labelled.jsonl", "k": 2,
                                                                        "max_chars": 120}},
        decoding={"temperature": 0.3, "max_tokens": 120, "seed": 5, "top_p": 0.95, "presence_penalty": 0.5,
                  "frequency_penalty": 0.2, "repetition_penalty": 1.1, "stop": ["\n\n"]},
        deadline="2026-12-01T06:00:00Z",
        validate={"max_dead_letter_rate": 0.05, "schema_sample": 10,
                  "drift": {"max_psi": 0.5, "max_new_categories": 1, "max_vanished_categories": 2},
                  "eval": {"labels": "tickets.jsonl", "label_field": "label", "sample": 20, "min_accuracy": 0.1}},
        retention={"versions": 3},
    )), **quiet)
    jobs.plan(write(work, "routed", base(
        "legacy-routed",
        routing={"class_field": "label", "providers": {
            "oai": {"api": "openai", "model": "gpt-4o-mini", "classes": ["Hardware"], "retention": "30 days",
                    "prices": {"input_per_mtok": 0.075, "output_per_mtok": 0.3}, "options": {"service_tier": "default"}},
            "claude": {"api": "anthropic", "model": "claude-haiku-4-5", "classes": ["Access"], "retention": "none",
                       "shard_size": 5}}},
    )), **quiet)
    batch_lines = work / "requests.jsonl"
    batch_lines.write_text("".join(json.dumps({
        "custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": f"ticket {i}"}]}}) + "\n" for i in range(5)))
    jobs.plan(write(work, "openai-batch", {
        "name": "legacy-openai-batch", "input": {"path": "requests.jsonl", "format": "openai-batch"},
        "model": {"engine": "synthetic"}, "output": {"schema": "triage.schema.json"}}), **quiet)

    # An Iceberg table's snapshot in the store's own catalog.
    rows = pq.read_table(work / "tickets.parquet")
    with open_catalog(TableRef("store", "src.tickets", warehouse=f"file://{work / 'source-wh'}"), url) as catalog:
        catalog.create_namespace_if_not_exists("src")
        src = catalog.create_table("src.tickets", schema=rows.schema)
        src.append(pa.Table.from_batches(rows.to_batches(), schema=rows.schema))
    jobs.run(write(work, "table-input", base("legacy-table-input", input={
        "table": {"catalog": "store", "name": "src.tickets"}, "acl_field": "acl"})), workers=1, **quiet)

    # Objects in S3: a glob and a manifest.
    with S3StandIn() as s3:
        bucket = s3.bucket()
        lines = (PINNED / "tickets.jsonl").read_bytes().splitlines(keepends=True)
        bucket.put("tickets/a.jsonl", b"".join(lines[:25]))
        bucket.put("tickets/b.jsonl", b"".join(lines[25:]))
        bucket.put("manifest.txt", b"tickets/b.jsonl\ntickets/a.jsonl\n")
        import os

        saved = dict(os.environ)
        os.environ.update(s3.env())
        try:
            jobs.plan(write(work, "objects", base("legacy-objects", input={
                "path": f"s3://{bucket.name}/tickets/*.jsonl", "acl_field": "acl",
                "storage": {"region": "us-east-1", "timeout_seconds": 10}})), **quiet)
            jobs.plan(write(work, "manifest", base("legacy-manifest", input={
                "manifest": f"s3://{bucket.name}/manifest.txt", "acl_field": "acl"})), **quiet)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    expected: dict[str, Any] = {"versions": {}, "history": {}}
    from batchline.store import open_store

    store = open_store(url)
    for listing in jobs.versions():
        info = store.job(listing.version)
        assert info is not None
        spec = stored_spec(info)
        status = jobs.status(listing.version)
        expected["versions"][listing.version] = {
            "name": info.name, "state": info.state, "records": info.record_count, "shards": info.shard_count,
            "stored": info.spec, "to_dict": json.loads(json.dumps(spec.to_dict(), default=str)),
            "inference_identity": spec.inference_identity(), "base_version": spec.base_version,
            "results": status.results, "dead_letters": status.dead_letters,
        }
    for name in sorted({v["name"] for v in expected["versions"].values()}):
        expected["history"][name] = [
            {"version": p.version, "previous": p.previous, "action": p.action, "reason": p.reason,
             "targets": p.targets, "validated": p.validation is not None}
            for p in jobs.history(name)]
        expected.setdefault("published", {})[name] = store.resolve_name(name)
    store.close()
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True, default=str) + "\n")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
