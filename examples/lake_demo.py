"""The ticket example over the lake: its input an object in S3, its results published into
an Iceberg table whose warehouse is in S3, read back by DuckDB from S3.

    python -m examples.lake_demo [--out demo/lake] [--example examples/tickets/job.yaml]
                                                              (make demo-lake)

S3 is the stand-in the tests use (`moto_server`, started here as a child process on a
free port of 127.0.0.1; examples/s3_standin.py). The demo makes a bucket, uploads the
example's input to it, writes a spec whose `input.path` is that object and whose
`output.table` is in the store's own SQL catalog with its warehouse in the bucket, and
runs it with `batchline run --publish` in an environment that names the stand-in
(`AWS_ENDPOINT_URL`, and its test keys): planning pins the object, the workers read
their byte ranges of it, and the publisher writes the table's files into the bucket.
DuckDB then reads the table through an S3 secret made of the same lake settings
(`batchline.lake`) and the keys from that environment, prints what it holds and
checks it against the store (examples/iceberg_demo.py).

The stand-in keeps its objects in memory, so each run starts from an empty store too.
The default example runs on the synthetic engine in seconds; examples/tickets/job.yaml
runs Gemma 3 270M through llama.cpp instead (minutes on two cores).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from batchline.lake import lake_settings
from examples.iceberg_demo import EXAMPLE, example_spec, read_back, run, write_spec
from examples.s3_standin import S3StandIn

BUCKET = "tickets-lake"


def demo(out: Path, example: Path = EXAMPLE, s3: S3StandIn | None = None) -> int:
    """Runs the demo in `out` (emptied first) against `s3`, or a stand-in of its own;
    0 when DuckDB's read of the table matches the store."""
    if s3 is None:
        with S3StandIn() as own:
            return demo(out, example, own)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    store_url = f"sqlite:///{out / 'batchline.db'}"
    spec = example_spec(example)
    env = s3.env()
    bucket = s3.bucket(BUCKET)
    local = Path(spec["input"]["path"])
    spec["input"]["path"] = bucket.put_file(f"input/{local.name}", local)
    print(f"S3 stand-in (moto_server) on {s3.url}: {local.name} uploaded as {spec['input']['path']}", flush=True)
    status = run(write_spec(out, spec, bucket.url("warehouse")), store_url, env)
    if status != 0:
        return status
    print(f"the table's files in s3://{bucket.name}/warehouse: {len(bucket.keys('warehouse/'))} objects")
    problems = read_back(store_url, str(spec["name"]), lake_settings(env=env), env)
    for problem in problems:
        print(f"demo-lake: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo/lake"), help="its store and spec (emptied first)")
    parser.add_argument("--example", type=Path, default=EXAMPLE, help="the example spec to run")
    args = parser.parse_args()
    return demo(args.out.resolve(), args.example.resolve())


if __name__ == "__main__":
    sys.exit(main())
