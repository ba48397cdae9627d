"""What the plan's ACLs and the database's fence on outcomes cost: the code of two
trees, before and after, measured in the same run on the same machine.

    python bench/worker_trust.py [--before /tmp/bl-base] [--after .] [--parts plan put publish]
                                 [--stores sqlite postgres] [--records 1000000] [--rounds 3]
                                 [--put-rounds 5] [--put-records 100000] [--publish-rounds 2]

Each measurement runs in a subprocess whose working directory and PYTHONPATH are one tree, so
`batchline` (the command and the library) is that tree's; the subprocess checks that it imported
the tree it was given. Rounds alternate which tree goes first; each run gets a new store (a SQLite
file in a folder of its own, or a database of its own on the PostgreSQL at 127.0.0.1:5432, trust
auth, dropped after: `bench/stores.py`). Per part, per store, per tree: each round's figure, the
minimum and the median, and the ratio of the medians, after / before, against its goal.

- `plan`: `batchline plan` of a full version of `--records` records with an ACL each (the input
  of `bench/backfill_50m.py`: Parquet, row groups of 100,000, `acl` a list; its spec), timed from
  the command's start to its exit. Goal: at most 1.15 x.
- `put`: a worker's put of 500 rows on PostgreSQL under the worker role. For each tree the owner
  plans a job of `--put-records` records (the input and per-shard spec of `bench/shard_files.py`,
  shards of 5,000) in a database of its own and makes the role (`batchline.ops.grants.grant`); a
  worker connected as that role (trust auth, user name = role; `open_store(..., worker=True)`)
  claims each shard and puts its records' results in 500-row flushes, each put timed alone (the
  shard's record ids are read by the owner before the clock starts). The two trees' workers take
  turns put by put (before, after, after, before, ...), so a change in the machine's speed over a
  round, which on a shared machine moves a round's median by a fifth, falls on both alike. Goal:
  the median put at most 1.1 x.
- `publish`: validate plus publish of a version of `--records` records whose Iceberg files the
  workers wrote (`files: per-shard`, as `bench/shard_files.py` makes it: JSONL input, shards of
  5,000, the synthetic engine at no cost, two local workers, the catalog in the store, the
  warehouse on local disk): `batchline run` first (timed, not the goal), then `validate` and
  `publish` in one process, each timed alone, as `bench/shard_files.py` times them. Goal: the
  sum at most 1.25 x.

The digest of the after tree's `batchline/` (its diff against the before tree's commit) is
printed when each part starts and ends: if someone changed it in between, the figures mix code.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUTPUT = '{"category":"Hardware","summary":"laptop screen flickers after update","entities":["laptop"]}'
GOALS = {"plan": 1.15, "put": 1.10, "publish": 1.25}
# A part's figures: (part, what, {"before": [...], "after": [...]}, unit, goal or None).
Row = tuple[str, str, dict[str, list[float]], str, float | None]


# --- in the subprocess: PYTHONPATH and the working directory are one tree ----------------------


def _check_tree(tree: str) -> None:
    import batchline

    if not Path(batchline.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"imported {batchline.__file__}, not the tree {tree}")


def child_put(tree: str, spec: str, url: str, role: str) -> dict[str, Any]:
    """Plans, makes the role, then (after printing `ready`) makes one put each time a line comes
    on its standard input, printing the put's seconds: the parent takes turns between trees."""
    import psycopg

    from batchline.acl import Acl
    from batchline.ops.grants import grant
    from batchline.store import ResultRow, open_store

    done = subprocess.run([sys.executable, "-m", "batchline", "plan", spec, "--store", url], check=True,
                          capture_output=True, text=True, cwd=tree)
    version = done.stdout.strip().splitlines()[-1]
    grant(url, version, role=role)
    with psycopg.connect(url) as conn:
        ids: dict[int, list[str]] = {}
        for shard_no, record_id in conn.execute(
                "SELECT shard_no, record_id FROM records WHERE version = %s ORDER BY shard_no, record_id", (version,)):
            ids.setdefault(shard_no, []).append(record_id)
    worker_url = url.replace("postgres@", f"{role}@", 1)
    store = open_store(worker_url, create=False, worker=True)
    took: list[float] = []
    print("ready", flush=True)
    try:
        while (lease := store.claim("bench-worker", version)) is not None:
            # As the worker makes them: each record's ACL as it read it (the input's `team-{i % 5}`)
            # and its piece, from the slice's pieces (in input order, as the record ids are).
            pieces = (lease.slice or {}).get("pieces") or []
            piece_of: list[int | None] = [int(p["no"]) for p in pieces for _ in range(int(p["records"]))]
            piece_of = piece_of or [None] * len(ids[lease.shard_no])
            rows = [ResultRow(r, OUTPUT, Acl([f"team-{int(r[2:]) % 5}"]), 1, 300, 20, piece=piece)
                    for r, piece in zip(ids[lease.shard_no], piece_of, strict=True)]
            for i in range(0, len(rows), 500):
                if not sys.stdin.readline():
                    raise SystemExit("the parent stopped taking turns")
                start = time.perf_counter()
                written = store.put_results(lease, rows[i:i + 500])
                took.append(time.perf_counter() - start)
                assert written == len(rows[i:i + 500]), written
                print(f"{took[-1]:.9f}", flush=True)
            store.complete(lease)
    finally:
        store.close()
    return {"version": version, "puts": took}


def child_publish(tree: str, spec: str, url: str, workers: int) -> dict[str, Any]:
    from batchline.check.validate import validate
    from batchline.publish.pointer import publish
    from batchline.store import open_store

    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batchline", "run", spec, "--store", url, "--workers",
                           str(workers)], capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"batchline run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    ran = time.perf_counter() - start
    version = done.stdout.strip().splitlines()[-1]
    store = open_store(url, create=False)
    try:
        start = time.perf_counter()
        outcome = validate(store, version)
        validated = time.perf_counter() - start
        assert outcome.passed, outcome
        start = time.perf_counter()
        publish(store, version)
        published = time.perf_counter() - start
    finally:
        store.close()
    return {"version": version, "run": ran, "validate": validated, "publish": published}


# --- the parent: inputs, stores, rounds, figures ------------------------------------------------


def tree_env(tree: Path) -> dict[str, str]:
    """The environment a subprocess of `tree` runs in (with its working directory the tree)."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def child_command(tree: Path, *args: str) -> list[str]:
    """This script as a child measuring in `tree`."""
    return [sys.executable, str(Path(__file__).resolve()), "--child", str(tree), *args]


def in_tree(tree: Path, command: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, cwd=tree, env=tree_env(tree), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def child(tree: Path, *args: str) -> dict[str, Any]:
    done = in_tree(tree, child_command(tree, *args))
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def after_digest(before: Path, after: Path) -> str:
    commit = subprocess.run(["git", "-C", str(before), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    diff = subprocess.run(["git", "-C", str(after), "diff", commit, "--", "batchline"], capture_output=True,
                          check=True).stdout
    untracked = subprocess.run(["git", "-C", str(after), "ls-files", "--others", "--exclude-standard", "batchline"],
                               capture_output=True, text=True, check=True).stdout.split()
    h = hashlib.sha256(diff)
    for name in sorted(untracked):
        h.update(name.encode() + (after / name).read_bytes())
    return f"{commit[:7]} + {h.hexdigest()[:12]}"


def drop_role(role: str) -> None:
    import psycopg
    from stores import PG_ADMIN

    with psycopg.connect(f"{PG_ADMIN}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def orders(rounds: int) -> list[tuple[str, str]]:
    return [("before", "after") if r % 2 == 0 else ("after", "before") for r in range(rounds)]


def part_plan(args: argparse.Namespace, trees: dict[str, Path], work: Path) -> list[Row]:
    from backfill_50m import write_input, write_spec
    from stores import new_store

    data = work / "plan-input.parquet"
    if not data.exists():
        write_input(data, args.records)
    figures: dict[str, dict[str, list[float]]] = {k: {"before": [], "after": []} for k in args.stores}
    for r, order in enumerate(orders(args.rounds)):
        for kind in args.stores:
            for side in order:
                folder = work / f"plan-{kind}-{side}-{r}"
                folder.mkdir()
                spec = folder / "full.yaml"
                write_spec(spec, data, folder, "trust-plan", base=False)
                with new_store(kind, folder, "bench_trust") as url:
                    start = time.perf_counter()
                    in_tree(trees[side], [sys.executable, "-m", "batchline", "plan", str(spec), "--store", url])
                    figures[kind][side].append(time.perf_counter() - start)
                shutil.rmtree(folder)
                print(f"plan, round {r + 1}, {kind}, {side}: {figures[kind][side][-1]:.1f} s", flush=True)
    return [("plan", kind, figures[kind], "s", GOALS["plan"]) for kind in args.stores]


def part_put(args: argparse.Namespace, trees: dict[str, Path], work: Path) -> list[Row]:
    from shard_files import write_input
    from stores import new_store

    data = work / "put-input.jsonl"
    write_input(data, args.put_records, 0)
    puts: dict[str, list[float]] = {"before": [], "after": []}
    totals: dict[str, list[float]] = {"before": [], "after": []}
    medians: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.put_rounds):
        roles = {side: f"bench_worker_{uuid.uuid4().hex[:10]}" for side in trees}
        try:
            with new_store("postgres", work, "bench_trust") as before_url, \
                    new_store("postgres", work, "bench_trust") as after_url:
                urls = {"before": before_url, "after": after_url}
                got = turns(args, trees, work, data, r, urls, roles)
        finally:
            for role in roles.values():
                drop_role(role)
        for side, took in got.items():
            puts[side].extend(took)
            totals[side].append(sum(took))
            medians[side].append(statistics.median(took))
        print(f"put, round {r + 1}: {len(got['after'])} puts of 500 rows each side, medians before "
              f"{medians['before'][-1] * 1000:.2f} ms, after {medians['after'][-1] * 1000:.2f} ms", flush=True)
    return [("put", "postgres, each put of 500 rows (every round's)", puts, "ms", GOALS["put"]),
            ("put", "postgres, the round's median put", medians, "ms", None),
            ("put", f"postgres, the {args.put_records // 500} puts of a round together", totals, "s", None)]


def turns(args: argparse.Namespace, trees: dict[str, Path], work: Path, data: Path, round_no: int,
          urls: dict[str, str], roles: dict[str, str]) -> dict[str, list[float]]:
    """Both trees' workers set up at once, then their puts one at a time, taking turns (before,
    after, after, before, ...): what the machine's speed does over the round, both sides feel."""
    from shard_files import write_spec

    children: dict[str, subprocess.Popen[str]] = {}
    for side, tree in trees.items():
        folder = work / f"put-{side}-{round_no}"
        folder.mkdir()
        spec = folder / "job.yaml"
        write_spec(spec, data, folder, "trust-put", per_shard=True)
        children[side] = subprocess.Popen(
            child_command(tree, "put", str(spec), urls[side], roles[side]), cwd=tree, env=tree_env(tree),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    took: dict[str, list[float]] = {side: [] for side in trees}
    try:
        for child in children.values():
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for i in range(args.put_records // 500):
            for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
                child = children[side]
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write("go\n")
                child.stdin.flush()
                took[side].append(float(child.stdout.readline()))
    finally:
        for side, child in children.items():
            if child.stdin is not None:
                child.stdin.close()
            child.wait()
            shutil.rmtree(work / f"put-{side}-{round_no}", ignore_errors=True)
    return took


def part_publish(args: argparse.Namespace, trees: dict[str, Path], work: Path) -> list[Row]:
    from shard_files import write_input, write_spec
    from stores import new_store

    data = work / "publish-input.jsonl"
    write_input(data, args.records, 0)
    figures: dict[str, dict[str, dict[str, list[float]]]] = {
        k: {s: {"run": [], "validate": [], "publish": [], "sum": []} for s in ("before", "after")}
        for k in args.stores}
    print(f"publish part started {datetime.datetime.now().isoformat(timespec='seconds')}", flush=True)
    for r, order in enumerate(orders(args.publish_rounds)):
        for kind in args.stores:
            for side in order:
                folder = work / f"publish-{kind}-{side}-{r}"
                folder.mkdir()
                spec = folder / "job.yaml"
                write_spec(spec, data, folder, "workers", per_shard=True)
                with new_store(kind, folder, "bench_trust") as url:
                    got = child(trees[side], "publish", str(spec), url, str(args.workers))
                shutil.rmtree(folder)
                f = figures[kind][side]
                for key in ("run", "validate", "publish"):
                    f[key].append(got[key])
                f["sum"].append(got["validate"] + got["publish"])
                print(f"publish, round {r + 1}, {kind}, {side}: run {got['run']:.1f} s, validate "
                      f"{got['validate']:.2f} s, publish {got['publish']:.2f} s, sum {f['sum'][-1]:.2f} s", flush=True)
    print(f"publish part ended {datetime.datetime.now().isoformat(timespec='seconds')}", flush=True)
    out: list[Row] = []
    for kind in args.stores:
        for key in ("sum", "validate", "publish", "run"):
            out.append(("publish", f"{kind}, {'validate + publish' if key == 'sum' else key}",
                        {s: figures[kind][s][key] for s in ("before", "after")}, "s",
                        GOALS["publish"] if key == "sum" else None))
    return out


def report(rows: list[Row]) -> None:
    print("\n| part | store, figure | before: min / median | after: min / median | after / before (medians) | goal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for part, label, sides, unit, goal in rows:
        b, a = sides["before"], sides["after"]
        if not b or not a:
            continue
        scale = 1000 if unit == "ms" else 1
        ratio = statistics.median(a) / statistics.median(b)
        verdict = "" if goal is None else f"≤ {goal} ({'met' if ratio <= goal else 'NOT met'})"
        print(f"| {part} | {label} | {min(b) * scale:.2f} / {statistics.median(b) * scale:.2f} {unit} (n {len(b)}) | "
              f"{min(a) * scale:.2f} / {statistics.median(a) * scale:.2f} {unit} (n {len(a)}) | {ratio:.3f} | "
              f"{verdict} |")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        tree_arg, what, *rest = sys.argv[2:]
        _check_tree(tree_arg)
        result = (child_put(tree_arg, *rest) if what == "put"
                  else child_publish(tree_arg, rest[0], rest[1], int(rest[2])))
        print(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--before", default="/tmp/bl-base", help="the tree before (a checkout of the base commit)")
    parser.add_argument("--after", default=str(ROOT), help="the tree after (default: this one)")
    parser.add_argument("--parts", nargs="+", choices=("plan", "put", "publish"), default=["plan", "put", "publish"])
    parser.add_argument("--stores", nargs="+", choices=("sqlite", "postgres"), default=["sqlite", "postgres"])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the plan part")
    parser.add_argument("--put-rounds", type=int, default=5)
    parser.add_argument("--put-records", type=int, default=100_000)
    parser.add_argument("--publish-rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for side, tree in trees.items():
        got = in_tree(tree, [sys.executable, "-c", "import batchline; print(batchline.__file__)"]).stdout.strip()
        print(f"{side}: {tree} (imports {got})")
    work = Path(tempfile.mkdtemp(prefix="bench-worker-trust-"))
    rows: list[Row] = []
    try:
        for part in args.parts:
            print(f"{part}: after tree {after_digest(trees['before'], trees['after'])} at start", flush=True)
            rows += {"plan": part_plan, "put": part_put, "publish": part_publish}[part](args, trees, work)
            print(f"{part}: after tree {after_digest(trees['before'], trees['after'])} at end", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.records:,} records (plan, publish), {args.put_records:,} (put); rounds: plan {args.rounds}, "
          f"put {args.put_rounds}, publish {args.publish_rounds}; before and after alternating, each run a new store")
    report(rows)
    print("command: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
