"""Two regions: what crosses between them, and what locality costs the makespan.

    python bench/regions.py [--store postgresql://postgres@127.0.0.1:5432/postgres] [--records 20000]

Each region is an S3 stand-in of its own (two `moto_server` processes). Each region's workers
reach S3 through their region's router, a plain HTTP relay that sends a bucket of its own region
to its own stand-in and a bucket of the other region to the other's through a slow link: 50 ms
added to each request (the round trip) and the response body paced to 20 MB/s. The router counts
the bytes that cross (request and response bodies on the slow link): the code under test counts
nothing here. Workers are real `batchline worker --region R` processes on the synthetic engine
(`seconds_per_record`, so a shard's work is compute as well as reading), on one PostgreSQL store.

Scenarios:
- one primary in region a, workers in both regions (2 + 2): without a replica, then with region b's
  replica (`input.replicas`): the bytes that cross;
- an input split 70/30 between the regions (`input.regions`), 7 workers in a and 3 in b: the share
  of shards that ran in their home region and the makespan, against the same job with every byte
  local (the routers relay everything directly).

The makespan is the store's: from the version's first claim to its seal.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.s3_standin import CREDENTIALS, S3StandIn

RTT_SECONDS = 0.05
LINK_BYTES_PER_SECOND = 20e6
CHUNK = 64 * 1024


class Router:
    """A region's way to S3: its own buckets straight to its stand-in, the other region's over
    the slow link (counted)."""

    def __init__(self, own: str, buckets: dict[str, str], standins: dict[str, str], slow: bool = True) -> None:
        self.own, self.buckets, self.standins, self.slow = own, buckets, standins, slow
        self.crossed = 0
        self.lock = threading.Lock()
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def _any(self) -> None:
                router.handle(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        bucket = urllib.parse.urlsplit(h.path).path.lstrip("/").split("/", 1)[0]
        region = self.buckets.get(bucket, self.own)
        cross = region != self.own
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        if cross and self.slow:
            time.sleep(RTT_SECONDS)
        upstream = urllib.parse.urlsplit(self.standins[region])
        conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=120)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection")}
        headers["Host"] = upstream.netloc
        conn.request(h.command, h.path, body=body or None, headers=headers)
        reply = conn.getresponse()
        h.send_response(reply.status)
        for key, value in reply.getheaders():
            if key.lower() not in ("connection", "transfer-encoding"):
                h.send_header(key, value)
        data = reply.read()
        h.end_headers()
        started = time.monotonic()
        sent = 0
        if h.command != "HEAD":
            for i in range(0, len(data), CHUNK):
                piece = data[i:i + CHUNK]
                h.wfile.write(piece)
                sent += len(piece)
                if cross and self.slow:
                    ahead = sent / LINK_BYTES_PER_SECOND - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
        conn.close()
        if cross:
            with self.lock:
                self.crossed += sent + len(body)


@contextlib.contextmanager
def database(admin: str) -> Iterator[str]:
    name = f"bench_regions_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    base = admin.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def records(n: int, prefix: str) -> bytes:
    # About 1 KB a record: reading is a real share of a shard's time over the slow link.
    pad = "x" * 900
    return "".join(json.dumps({"id": f"{prefix}{i:07d}", "text": f"ticket {i} {pad}", "acl": ["staff"]}) + "\n"
                   for i in range(n)).encode()


def put_objects(standin: S3StandIn, bucket: str, prefix: str, data: bytes, parts: int) -> None:
    lines = data.splitlines(keepends=True)
    per = -(-len(lines) // parts)
    for i in range(parts):
        standin.client.put_object(Bucket=bucket, Key=f"{prefix}/part-{i:03d}.jsonl",
                                  Body=b"".join(lines[i * per:(i + 1) * per]))


def run_job(store_url: str, spec: dict[str, Any], workers: dict[str, int], routers: dict[str, Router],
            work: Path, unnamed: tuple[str, ...] = ()) -> dict[str, Any]:
    """Runs the job to its seal with `workers[R]` workers behind region R's router, each told its
    region, except those of `unnamed` regions (a region the input does not know is refused)."""
    spec_path = work / f"{spec['name']}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **CREDENTIALS, "BATCHLINE_STORE": store_url, "PYTHONUNBUFFERED": "1"}
    planned = subprocess.run([sys.executable, "-m", "batchline", "plan", str(spec_path)],
                             env={**env, "AWS_ENDPOINT_URL": routers["a"].url}, capture_output=True, text=True,
                             check=True)
    version = planned.stdout.strip().splitlines()[-1]
    for r in routers.values():
        r.crossed = 0
    log = (work / f"{spec['name']}.log").open("ab")
    procs = [subprocess.Popen([sys.executable, "-m", "batchline", "worker", "--job", version, "--poll-seconds", "0.2",
                               *(["--region", region] if region not in unnamed else [])],
                              env={**env, "AWS_ENDPOINT_URL": routers[region].url}, stdout=log, stderr=log)
             for region, n in workers.items() for _ in range(n)]
    for p in procs:
        if p.wait(1800) != 0:
            raise RuntimeError(f"a worker exited {p.returncode}: see {log.name}")
    with psycopg.connect(store_url) as conn:
        first, sealed = conn.execute(
            "SELECT min(ts) FILTER (WHERE kind = 'claim'), max(ts) FILTER (WHERE kind = 'seal') FROM events "
            "WHERE version = %s", (version,)).fetchone()
        shards = conn.execute("SELECT home, ran_in, count(*) FROM shards WHERE version = %s GROUP BY 1, 2",
                              (version,)).fetchall()
        results = conn.execute("SELECT count(*) FROM results WHERE version = %s", (version,)).fetchone()[0]
    total = sum(int(c) for _h, _r, c in shards)
    home = sum(int(c) for h, r, c in shards if h is None or h == r)
    return {"version": version, "makespan_s": float(sealed) - float(first), "shards": total,
            "home_share": home / total if total else 0.0, "results": int(results),
            "crossed_bytes": sum(r.crossed for r in routers.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="postgresql://postgres@127.0.0.1:5432/postgres",
                    help="an admin URL: a database of its own is made and dropped")
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--seconds-per-record", type=float, default=0.01)
    ap.add_argument("--shard-size", type=int, default=500)
    ap.add_argument("--locality-wait", type=float, default=5.0)
    args = ap.parse_args()
    with S3StandIn() as sa, S3StandIn() as sb, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        standins = {"a": sa.url, "b": sb.url}
        ba, bb = "primary-a", "copy-b"
        sa.client.create_bucket(Bucket=ba)
        sb.client.create_bucket(Bucket=bb)
        data = records(args.records, "p")
        put_objects(sa, ba, "in", data, 8)
        put_objects(sb, bb, "in", data, 8)
        split_a, split_b = "split-a", "split-b"
        sa.client.create_bucket(Bucket=split_a)
        sb.client.create_bucket(Bucket=split_b)
        cut = int(args.records * 0.7)
        put_objects(sa, split_a, "in", records(cut, "a"), 7)
        put_objects(sb, split_b, "in", records(args.records - cut, "b"), 3)
        buckets = {ba: "a", split_a: "a", bb: "b", split_b: "b"}
        model = {"engine": "synthetic", "options": {"seconds_per_record": args.seconds_per_record}}
        base = {"model": model, "prompt": {"text": "Classify.", "version": "v1"},
                "output": {"schema": {"type": "object"}},
                "shards": {"size": args.shard_size, "locality_wait_seconds": args.locality_wait}}
        rows: list[tuple[str, dict[str, Any]]] = []
        with database(args.store) as url:
            for slow in (True, False):
                routers = {r: Router(r, buckets, standins, slow=slow) for r in ("a", "b")}
                try:
                    if slow:
                        primary = {"path": f"s3://{ba}/in/*.jsonl", "acl_field": "acl", "region": "a"}
                        # The input knows region a alone: b's workers run without --region (the router
                        # still counts what they read from a).
                        rows.append(("primary in a, no replica, 2+2 workers", run_job(
                            url, {"name": "no-replica", "input": primary, **base}, {"a": 2, "b": 2}, routers, work,
                            unnamed=("b",))))
                        rows.append(("primary in a, replica in b, 2+2 workers", run_job(
                            url, {"name": "replica", "input": {**primary, "replicas": {"b": f"s3://{bb}/in/"}},
                                  **base}, {"a": 2, "b": 2}, routers, work)))
                    split = {"regions": {"a": f"s3://{split_a}/in/*.jsonl", "b": f"s3://{split_b}/in/*.jsonl"},
                             "acl_field": "acl"}
                    name = "split-slow" if slow else "split-local"
                    rows.append((f"70/30 split, 7+3 workers, {'slow link' if slow else 'every byte local'}",
                                 run_job(url, {"name": name, "input": split, **base}, {"a": 7, "b": 3}, routers,
                                         work)))
                finally:
                    for r in routers.values():
                        r.close()
    print(f"regions bench: {args.records:,} records of ~1 KB, shards of {args.shard_size}, "
          f"{args.seconds_per_record * 1000:g} ms a record, locality wait {args.locality_wait:g} s; "
          f"link between regions +{RTT_SECONDS * 1000:g} ms a request, {LINK_BYTES_PER_SECOND / 1e6:g} MB/s; "
          "bytes counted at the routers")
    print(f"{'scenario':48} {'results':>8} {'crossed bytes':>14} {'home shards':>12} {'makespan':>9}")
    for label, r in rows:
        print(f"{label:48} {r['results']:>8,} {r['crossed_bytes']:>14,} {r['home_share']:>11.1%} "
              f"{r['makespan_s']:>8.1f}s")
    slow_split = next(r for label, r in rows if "slow link" in label)
    local_split = next(r for label, r in rows if "every byte local" in label)
    print(f"makespan with the slow link / every byte local: {slow_split['makespan_s'] / local_split['makespan_s']:.2f}")


if __name__ == "__main__":
    main()
