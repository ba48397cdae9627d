"""A nightly version of a retrieval index built on its base against a full build of it: time,
bytes written, recall@k and search latency of each.

    python bench/index_nightly.py [--rows 1000000] [--changed 0.05] [--where random|recent]
                                  [--queries 100] [--dims 384] [--k 10] [--refine-factor 30 ...]
                                  [--rewrite-deleted-share 1 0.03 ...]

Seeded random unit vectors of --dims dimensions, each row's ACL `["all"]`, go through the lancedb
target's own code: the full version is every row written in one commit, its indexes built (the
ACL's LABEL_LIST; the IVF_PQ index, every partition probed at search), optimized and tagged; a
nightly version is the full one's Lance version made the latest again, --changed of the rows given
new vectors (`--where random`: spread at random; `recent`: the last ones) upserted by id, the files
whose deleted rows reach its `rewrite_deleted_share` rewritten without them, the indexes brought up
to its rows by Lance's optimize (no training again) and tagged: one nightly version, from the same
base, for each --rewrite-deleted-share (by default 1, never rewriting, and the target's default).
Making the rows is the bench's own work, timed and taken out. Bytes written are what each version
adds under the index's folder. Then --queries seeded random queries as the group `all` against
each version: exact, and approximate as the target searches (recall@k: the share of the exact top
k the approximate search returns), with each version's unindexed rows; at each --refine-factor
given (the target's default, 30, unless told), the same for every version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from retrieval_index import Stopwatch, folder_bytes, percentile, recall, spec_for, unit_vectors  # noqa: E402

from batchline.acl import Acl  # noqa: E402
from batchline.store import StoredResult  # noqa: E402
from batchline.targets.lancedb_index import (  # noqa: E402
    DEFAULT_REFINE_FACTOR,
    DEFAULT_REWRITE_DELETED_SHARE,
    IndexOutput,
    LanceIndex,
    apply_changes,
    finish_version,
    version_tag,
    write_table,
)

ALL = Acl(["all"])  # every row's ACL

FULL = "bench@0000000000000001"


def nightly(i: int) -> str:
    return f"bench@{i + 2:016d}"
CHUNK = 10_000


def results(ids: list[int], dims: int, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    for start in range(0, len(ids), CHUNK):
        block = ids[start:start + CHUNK]
        for i, vector in zip(block, unit_vectors(rng, len(block), dims), strict=True):
            yield StoredResult(f"r{i:08d}", json.dumps({"embedding": vector.tolist()}), ALL, 0, "bench", 1, 1,
                               0.0, None, None)


def searched(index: LanceIndex, version: str, qs: Any, k: int) -> dict[str, Any]:
    """recall@k and latency of the version's approximate search against its exact one, and
    its indexes' unindexed rows."""
    opened = index._version("bench", version)
    assert opened is not None
    checked_out = opened[0]
    unindexed = {ix.name: checked_out.index_stats(ix.name).num_unindexed_rows  # type: ignore[union-attr]
                 for ix in checked_out.list_indices()}
    found: dict[bool, tuple[list[float], list[list[str]]]] = {}
    for exact in (True, False):
        index.search("bench", version, qs[0].tolist(), ["all"], k, exact=exact)  # warm the caches
        times, ids = [], []
        for q in qs:
            t0 = time.perf_counter()
            hits = index.search("bench", version, q.tolist(), ["all"], k, exact=exact).hits
            times.append(time.perf_counter() - t0)
            ids.append([h.record_id for h in hits])
        found[exact] = (times, ids)
    return {"unindexed": unindexed, "recall": recall(found[False][1], found[True][1], k),
            "approx p50 ms": 1000 * statistics.median(found[False][0]),
            "approx p99 ms": 1000 * percentile(found[False][0], 0.99),
            "exact p50 ms": 1000 * statistics.median(found[True][0])}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--changed", type=float, default=0.05)
    parser.add_argument("--where", choices=("random", "recent"), default="random")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--dims", type=int, default=384)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--refine-factor", type=int, nargs="+", default=[DEFAULT_REFINE_FACTOR],
                        help="search every version at each of these refine factors (every partition probed)")
    parser.add_argument("--rewrite-deleted-share", type=float, nargs="+",
                        default=[1.0, DEFAULT_REWRITE_DELETED_SHARE],
                        help="a nightly version from the same base for each of these output.index.rewrite_deleted_share")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-index-nightly-"))
    spec = spec_for(root, args.dims)
    output = IndexOutput(str(root / "index"), approximate_min_rows=1)
    index = LanceIndex(output)
    db = index.connect()
    n = args.rows

    made = Stopwatch(results(list(range(n)), args.dims, seed=1))
    started = time.perf_counter()
    schema, batches = index.rows(spec, FULL, iter(made))
    write_table(db, "bench", schema, batches)
    table = db.open_table("bench")
    finish_version(table, output, version_tag(FULL))
    full_seconds = time.perf_counter() - started - made.seconds
    full_bytes = folder_bytes(root / "index")
    print(f"full version: {n:,} rows in {full_seconds:.1f} s, {full_bytes / 1e6:.0f} MB", flush=True)

    k_changed = int(n * args.changed)
    changed = (sorted(np.random.default_rng(3).choice(n, k_changed, replace=False).tolist())
               if args.where == "random" else list(range(n - k_changed, n)))
    nights: list[tuple[str, str, float, float]] = []  # label, version, seconds, bytes
    for i, share in enumerate(args.rewrite_deleted_share):
        version, label = nightly(i), f"nightly, rewrite_deleted_share {share:g}"
        made = Stopwatch(results(changed, args.dims, seed=2))
        written = folder_bytes(root / "index")
        started = time.perf_counter()
        table = db.open_table("bench")
        base = int(table.tags.get_version(version_tag(FULL)))
        apply_changes(table, base, index.rows(spec, version, iter(made)), iter([]))
        finish_version(table, dataclasses.replace(output, rewrite_deleted_share=share), version_tag(version))
        seconds = time.perf_counter() - started - made.seconds
        nights.append((label, version, seconds, folder_bytes(root / "index") - written))
        print(f"{label}: {k_changed:,} rows changed in {seconds:.1f} s, {nights[-1][3] / 1e6:.0f} MB", flush=True)

    qs = unit_vectors(np.random.default_rng(7), args.queries, args.dims)
    print(f"\n{n:,} rows of {args.dims} dimensions, {k_changed:,} changed ({args.where}), {args.queries} queries, "
          f"k {args.k}, every partition probed")
    for label, _version, seconds, written in nights:
        print(f"{label}: time {seconds:.1f} s / full {full_seconds:.1f} s = {seconds / full_seconds:.3f}; "
              f"bytes {written / 1e6:.0f} MB / full {full_bytes / 1e6:.0f} MB = {written / full_bytes:.3f}")
    for refine in args.refine_factor:
        searcher = LanceIndex(dataclasses.replace(output, refine_factor=refine))
        figures = {label: searched(searcher, version, qs, args.k)
                   for label, version in [("full", FULL)] + [(label, v) for label, v, _, _ in nights]}
        for label, f in figures.items():
            print(f"refine {refine}, {label}: recall@{args.k} {f['recall']:.3f}, approximate p50 "
                  f"{f['approx p50 ms']:.1f} ms (p99 {f['approx p99 ms']:.1f}), exact p50 {f['exact p50 ms']:.1f} ms, "
                  f"unindexed rows {f['unindexed']}")
        for label, _, _, _ in nights:
            print(f"refine {refine}, search p50, {label} over full: "
                  f"approximate {figures[label]['approx p50 ms'] / figures['full']['approx p50 ms']:.2f}, "
                  f"exact {figures[label]['exact p50 ms'] / figures['full']['exact p50 ms']:.2f}", flush=True)
    print(f"command: python bench/index_nightly.py --rows {n} --changed {args.changed} --where {args.where} "
          f"--queries {args.queries} --dims {args.dims} --k {args.k} "
          f"--refine-factor {' '.join(map(str, args.refine_factor))} "
          f"--rewrite-deleted-share {' '.join(f'{x:g}' for x in args.rewrite_deleted_share)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
