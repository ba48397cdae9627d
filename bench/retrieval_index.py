"""The retrieval index: how fast a version's rows are written into LanceDB, how fast a search
behind the ACL prefilter answers, exact and approximate, how much the approximate index
loses, and what a row costs on disk.

    python bench/retrieval_index.py [--rows 100000 1000000] [--queries 100] [--dims 384] [--k 10]

For each row count: seeded random unit vectors of --dims dimensions (for scale; the
synthetic engine's vectors are all the same), each row's ACL `["all"]`, and for one row in
a hundred also `"rare"`. The rows go through the lancedb target's own write path (the
results as the store hands them out, JSON text, turned into Arrow batches, the table
created in one commit, the ACL's LABEL_LIST index): "write rows/s" (making the rows, the
bench's own work, is timed as it happens and taken out). Then --queries
searches (seeded random unit vectors) as the group `all` (unselective: every row visible)
and as `rare` (selective: 1%), exact; the IVF_PQ index is built (its seconds reported) and
the same searches run as the target runs them once a version has that index (every partition
probed and the refine factor; exact where the ACL leaves at most EXACT_BELOW_SHARE of the
rows visible, or where fewer than k come back). recall@10: the share of the exact top k the
approximate search returns (--nprobes and --refine-factor: the same searches with other
settings on the same index). Bytes per row: the table's folder, before and after the
vector index, over the rows.

The revocation check (a search of an index over a published job admits each candidate by the
ACL that job publishes now): an upstream job of the same ids and ACLs is run through
`batchline run --publish` into --store (synthetic engine, no time per record), and the
approximate searches run again with each candidate looked up there (`CurrentAcls`, one keyed
read per batch of candidates): "checked" with nothing revoked, then "revoked 10%" after an
upstream version in which every tenth row's ACL no longer names `all` (an ACL-only change,
carried without inference) is published, so a tenth of the candidates are withheld and
further ones fetched until k are admitted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchline.acl import Acl
from batchline.publish.upstream import CurrentAcls, Level
from batchline.spec import parse_spec
from batchline.store import StoredResult, open_store
from batchline.targets.lancedb_index import (
    DEFAULT_REFINE_FACTOR,
    EXACT_BELOW_SHARE,
    IndexOutput,
    LanceIndex,
    build_indexes,
    ivf_partitions,
    table_name,
    write_table,
)

ALL, RARE = Acl(["all"]), Acl(["all", "rare"])  # every row's ACL; one row in a hundred's

VERSION = "bench@0123456789abcdef"
CHUNK = 10_000


def unit_vectors(rng: np.random.Generator, n: int, dims: int) -> np.ndarray:
    v = rng.standard_normal((n, dims)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v


def results(rows: int, dims: int, seed: int) -> Iterator[StoredResult]:
    """The version's results as the store hands them out: the output as JSON text."""
    rng = np.random.default_rng(seed)
    for start in range(0, rows, CHUNK):
        block = unit_vectors(rng, min(CHUNK, rows - start), dims)
        for j, vector in enumerate(block):
            i = start + j
            yield StoredResult(f"r{i:08d}", json.dumps({"embedding": vector.tolist()}),
                               RARE if i % 100 == 0 else ALL, 0, "bench", 1, 1, 0.0, None, None)


class Stopwatch:
    """An iterator that sums the time its source takes to make each item."""

    def __init__(self, source: Iterator[StoredResult]) -> None:
        self.source = source
        self.seconds = 0.0

    def __iter__(self) -> Iterator[StoredResult]:
        while True:
            t0 = time.perf_counter()
            item = next(self.source, None)
            self.seconds += time.perf_counter() - t0
            if item is None:
                return
            yield item


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def spec_for(root: Path, dims: int) -> Any:
    (root / "in.jsonl").write_text('{"id": "a", "text": "x", "acl": ["all"]}\n')
    schema = {"type": "object", "properties": {"embedding": {"type": "array", "items": {"type": "number"},
                                                             "minItems": dims, "maxItems": dims}}}
    return parse_spec({"name": "bench", "input": {"path": "in.jsonl", "acl_field": "acl"},
                       "model": {"engine": "synthetic"}, "prompt": {"text": "x", "version": "v1"},
                       "output": {"schema": schema, "index": {"uri": str(root / "index")}}}, base_dir=root)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def acl_of(i: int, revoked: bool = False) -> list[str]:
    if revoked and i % 10 == 5:
        return ["other", "rare"] if i % 100 == 0 else ["other"]  # no longer `all`
    return ["all", "rare"] if i % 100 == 0 else ["all"]


def publish_upstream(rows: int, root: Path, store_url: str, revoked: bool) -> tuple[str, float]:
    """The upstream job over the bench's ids and ACLs, run and published; its version and the
    seconds `batchline run --publish` took."""
    import subprocess

    import yaml

    name = "revoked" if revoked else "first"
    with (root / f"{name}.jsonl").open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"r{i:08d}", "text": f"ticket {i}", "acl": acl_of(i, revoked)}) + "\n")
    schema = Path(__file__).resolve().parents[1] / "examples" / "tickets" / "triage.schema.json"
    (root / f"{name}.yaml").write_text(yaml.safe_dump({
        "name": "bench-upstream", "base": "published", "input": {"path": str(root / f"{name}.jsonl"), "acl_field": "acl"},
        "model": {"engine": "synthetic"}, "prompt": {"text": "Classify.", "version": "v1"},
        "output": {"schema": str(schema), "label_field": "category"}, "shards": {"size": 5000},
        "validate": {"drift": {"max_psi": 10, "max_new_categories": 10}}}))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batchline", "run", str(root / f"{name}.yaml"), "--store", store_url,
                           "--workers", "2", "--publish"], check=True, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1], time.perf_counter() - started


def run(rows: int, queries: int, dims: int, k: int, root: Path, probes: list[int] = [],  # noqa: B006
        refines: list[int] = [], store_url: str | None = None) -> dict[str, Any]:  # noqa: B006
    spec = spec_for(root, dims)
    output = IndexOutput(str(root / "index"), approximate_min_rows=rows + 1)
    index = LanceIndex(output)
    db = index.connect()
    name = table_name("bench", VERSION)

    # Making the rows is the bench's own work, not the index's: the time spent in the
    # generator is summed and taken out.
    made = Stopwatch(results(rows, dims, seed=rows))
    started = time.perf_counter()
    schema, batches = index.rows(spec, VERSION, iter(made))
    write_table(db, name, schema, batches)
    build_indexes(db.open_table(name), output)
    write_seconds = time.perf_counter() - started - made.seconds
    table_dir = next((root / "index").glob(f"{name}*"))
    bytes_exact = folder_bytes(table_dir)

    qs = unit_vectors(np.random.default_rng(7), queries, dims)
    groups = {"unselective": ["all"], "selective 1%": ["rare"]}

    def searches(exact: bool, index: LanceIndex = index, current: CurrentAcls | None = None
                 ) -> dict[str, tuple[list[float], list[list[str]]]]:
        out: dict[str, tuple[list[float], list[list[str]]]] = {}
        for label, g in groups.items():
            admit = None if current is None else (lambda ids, g=g: current.admitted(ids, g))
            index.search("bench", VERSION, qs[0].tolist(), g, k, exact=exact, admit=admit)  # warm the caches
            times, ids = [], []
            for q in qs:
                t0 = time.perf_counter()
                hits = index.search("bench", VERSION, q.tolist(), g, k, exact=exact, admit=admit).hits
                times.append(time.perf_counter() - t0)
                ids.append([h.record_id for h in hits])
                assert len(hits) == k, (label, len(hits))
            out[label] = (times, ids)
        return out

    exact = searches(exact=True)
    started = time.perf_counter()
    build_indexes(db.open_table(name), IndexOutput(output.uri, approximate_min_rows=1))
    index_seconds = time.perf_counter() - started
    bytes_approx = folder_bytes(table_dir)
    approx = searches(exact=False)
    settings = {}
    for nprobes in probes:
        for refine in refines:
            tuned = LanceIndex(IndexOutput(output.uri, nprobes=nprobes, refine_factor=refine))
            settings[(nprobes, refine)] = searches(exact=False, index=tuned)

    checked: dict[str, dict[str, tuple[list[float], list[list[str]]]]] = {}
    upstream_seconds: dict[str, float] = {}
    if store_url is not None:
        store = open_store(store_url)
        try:
            first, upstream_seconds["full run"] = publish_upstream(rows, root, store_url, revoked=False)
            checked["checked"] = searches(False, current=CurrentAcls(VERSION, [Level("bench-upstream", first, first)],
                                                                     store))
            revoked, upstream_seconds["revoked 10%, ACL-only run"] = publish_upstream(rows, root, store_url, True)
            current = CurrentAcls(VERSION, [Level("bench-upstream", first, revoked)], store)
            checked["revoked 10%"] = searches(False, current=current)
            assert all(int(rid[1:]) % 10 != 5 for ids in checked["revoked 10%"]["unselective"][1] for rid in ids)
        finally:
            store.close()

    figures: dict[str, Any] = {"rows": rows, "dims": dims, "queries": queries, "k": k,
                               "write_rows_per_s": rows / write_seconds, "write_seconds": write_seconds,
                               "ivf_pq_seconds": index_seconds, "partitions": ivf_partitions(rows),
                               "nprobes": ivf_partitions(rows), "refine_factor": DEFAULT_REFINE_FACTOR,
                               "exact_below_share": EXACT_BELOW_SHARE,
                               "bytes_per_row": bytes_exact / rows, "bytes_per_row_with_ivf_pq": bytes_approx / rows}
    for label in groups:
        for kind, found in (("exact", exact), ("approximate", approx)):
            times = found[label][0]
            figures[f"{kind} {label} p50 ms"] = 1000 * statistics.median(times)
            figures[f"{kind} {label} p99 ms"] = 1000 * percentile(times, 0.99)
        for kind, found in checked.items():
            figures[f"approximate {label} p50 ms ({kind})"] = 1000 * statistics.median(found[label][0])
            figures[f"approximate {label} p99 ms ({kind})"] = 1000 * percentile(found[label][0], 0.99)
        figures[f"recall@{k} {label}"] = recall(approx[label][1], exact[label][1], k)
        for (nprobes, refine), found in settings.items():
            where = f"nprobes {nprobes}, refine {refine}"
            figures[f"approximate {label} p50 ms ({where})"] = 1000 * statistics.median(found[label][0])
            figures[f"recall@{k} {label} ({where})"] = recall(found[label][1], exact[label][1], k)
    for what, seconds in upstream_seconds.items():
        figures[f"upstream {what} s"] = seconds
    return figures


def recall(approx: list[list[str]], exact: list[list[str]], k: int) -> float:
    return statistics.mean(len(set(a) & set(e)) / k for a, e in zip(approx, exact, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--dims", type=int, default=384)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--nprobes", type=int, nargs="*", default=[],
                        help="also search the approximate index with these nprobes (each with each --refine-factor)")
    parser.add_argument("--refine-factor", type=int, nargs="*", default=[DEFAULT_REFINE_FACTOR])
    parser.add_argument("--work-dir", type=Path, default=None, help="where the tables go (default: a temporary folder)")
    parser.add_argument("--store", default="sqlite", metavar="URL",
                        help="the store the upstream job of the revocation check runs in: sqlite (a new file in the "
                             "work folder, the default), a postgresql:// URL of an empty database, or none to skip it")
    args = parser.parse_args()
    for rows in args.rows:
        with tempfile.TemporaryDirectory(prefix="bench-index-", dir=args.work_dir) as tmp:
            store_url = {"sqlite": f"sqlite:///{Path(tmp) / 'store.db'}", "none": None}.get(args.store, args.store)
            figures = run(rows, args.queries, args.dims, args.k, Path(tmp), args.nprobes,
                          args.refine_factor if args.nprobes else [], store_url)
        width = max(len(key) for key in figures)
        print(f"== {rows:,} rows")
        for key, value in figures.items():
            print(f"{key:<{width}}  {value:,.3f}" if isinstance(value, float) else f"{key:<{width}}  {value:,}")
        print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
