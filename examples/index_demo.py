"""The ticket example's summaries embedded, published into a LanceDB index, and searched
as two groups.

    python -m examples.index_demo [--out demo/index]      (make demo-index)

1. The triage example on the synthetic engine (examples/tickets/synthetic.yaml over the
   299 tickets of demo.jsonl) is run and published: a category and a summary per ticket,
   each result with its ticket's ACL.
2. An embedding job (the packaged MiniLM model) over the published triage's summaries
   (`input.job`, `input.field: output.summary`: each ticket's ACL comes with it) publishes
   its vectors into a LanceDB index under the demo's folder (`output.index`), each row
   with the ticket's category and summary.
3. `batchline search` as two groups, with a ticket's own summary as the query: a ticket
   only the service desk may see (ACL `["it-service-desk"]`) never reaches a caller of the
   group `hr-confidential`, and comes first for a caller of `it-service-desk`; an HR ticket
   reaches `hr-confidential`.

Run it twice and the second run finds both versions done and published already.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from batchline.api import Jobs

EXAMPLES = Path(__file__).resolve().parent / "tickets"
TRIAGE = EXAMPLES / "synthetic.yaml"
EMBEDDING_SCHEMA = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number"}}},
                    "required": ["embedding"]}


def batchline(*args: str) -> subprocess.CompletedProcess[str]:
    """A `batchline` command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "batchline", *args], text=True, stdout=subprocess.PIPE,
                          env=os.environ.copy())


def triage_spec(out: Path) -> Path:
    spec = yaml.safe_load(TRIAGE.read_text())
    spec["input"]["path"] = str(EXAMPLES / "demo.jsonl")
    spec["prompt"]["file"] = str(EXAMPLES / spec["prompt"]["file"])
    spec["output"]["schema"] = str(EXAMPLES / spec["output"]["schema"])
    path = out / "triage.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def summaries(store_url: str, name: str, out: Path) -> list[dict[str, Any]]:
    """The published triage's summaries with their tickets' ACLs, to choose the queries from."""
    exported = out / "triage-results.jsonl"
    Jobs(store_url).export(name, out=exported)
    return [{"id": row["id"], "summary": row["output"]["summary"], "acl": row["acl"]}
            for row in map(json.loads, exported.read_text().splitlines())]


def embedding_spec(out: Path, triage: str) -> Path:
    from batchline.engines.models import MINILM_PACKAGE, packaged_model_digest

    (out / "embedding.schema.json").write_text(json.dumps(EMBEDDING_SCHEMA, indent=2))
    spec = {
        "name": "ticket-summaries",
        "input": {"job": triage, "field": "output.summary", "acl_field": "acl"},
        "model": {"engine": "embedding", "digest": packaged_model_digest(MINILM_PACKAGE),
                  "options": {"device": "cpu"}},
        "prompt": {"text": "Embed the summary.\n", "version": "v1"},
        "output": {"schema": "embedding.schema.json",
                   "index": {"uri": str(out / "index"), "fields": ["category", "summary"]}},
        "shards": {"size": 100, "batch_size": 32},
    }
    path = out / "embedding.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def search(store_url: str, query: str, group: str, k: int = 5) -> list[dict[str, Any]]:
    done = batchline("search", "ticket-summaries", "--query", query, "--groups", group, "--k", str(k), "--json",
                     "--store", store_url)
    if done.returncode != 0:
        raise SystemExit(done.returncode)
    found = json.loads(done.stdout)
    print(f"\n$ batchline search ticket-summaries --query {query[:40]!r}... --groups {group} --k {k}")
    for hit in found["hits"]:
        print(f"  {hit['score']:.4f}  {hit['id']}  {hit['fields']['category']:<22}  {hit['fields']['summary'][:50]!r}")
    hits: list[dict[str, Any]] = found["hits"]
    return hits


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo/index"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    store_url = f"sqlite:///{out / 'batchline.db'}"
    triage = yaml.safe_load(TRIAGE.read_text())["name"]
    for spec in (triage_spec(out),):
        if batchline("run", str(spec), "--store", store_url, "--workers", "1", "--publish").returncode != 0:
            return 1
    if batchline("run", str(embedding_spec(out, triage)), "--store", store_url, "--workers", "1",
                 "--publish").returncode != 0:
        return 1

    rows = summaries(store_url, triage, out)
    desk_only = next(r for r in rows if r["acl"] == ["it-service-desk"])
    hr = next(r for r in rows if "hr-confidential" in r["acl"])
    print(f"\nticket {desk_only['id']} (acl {desk_only['acl']}): {desk_only['summary']!r}")
    problems = []
    if any(h["id"] == desk_only["id"] for h in search(store_url, desk_only["summary"], "hr-confidential")):
        problems.append(f"{desk_only['id']} reached hr-confidential")
    if search(store_url, desk_only["summary"], "it-service-desk")[0]["id"] != desk_only["id"]:
        problems.append(f"{desk_only['id']} did not come first for it-service-desk")
    print(f"\nticket {hr['id']} (acl {hr['acl']}): {hr['summary']!r}")
    if search(store_url, hr["summary"], "hr-confidential")[0]["id"] != hr["id"]:
        problems.append(f"{hr['id']} did not come first for hr-confidential")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    if not problems:
        print(f"\nchecked: {desk_only['id']} never reaches hr-confidential, even for its own summary, and comes first "
              f"for it-service-desk; {hr['id']} reaches hr-confidential")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
