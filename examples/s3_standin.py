"""The S3 stand-in: an S3 protocol server (`moto_server`, from the moto package) run as a
child process on a free port of 127.0.0.1, for whatever needs a lake where the real
service cannot be reached: `make demo-lake` and the tests.

It lives here, beside the demos, rather than in tests/: a demo is run by users and must
not import test code (tests/integration/lake/support.py carries pytest fixtures and fault fakes),
while the tests may import an example. batchline itself never imports it; moto comes
with the dev extra.

    with S3StandIn() as s3:
        bucket = s3.bucket(versioned=True)
        url = bucket.put("in/tickets.jsonl", data)       # s3://bl-.../in/tickets.jsonl
        subprocess.run([...], env={**os.environ, **s3.env()})
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

# What the stand-in accepts; a client gets them from the environment, as it would real ones.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_up(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before answering")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer on {url} within {timeout:.0f}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ChildServer:
    """A stand-in server run as a child process on a free port of 127.0.0.1; closed on exit
    from a `with` block."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, command: list[str], probe: str, what: str) -> None:
        """Runs `command` and waits until `probe` answers; a server that never does is stopped."""
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until_up(probe, self.proc, what)
        except RuntimeError:
            self.close()
            raise

    @staticmethod
    def fresh_name() -> str:
        return f"bl-{uuid.uuid4().hex[:12]}"

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@dataclass
class Bucket:
    name: str
    versioned: bool
    scheme: ClassVar[str] = ""

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.name}/{key}"

    def put(self, key: str, data: bytes) -> str:
        """Uploads `data` and returns the object's URL."""
        raise NotImplementedError

    def put_file(self, key: str, path: Path) -> str:
        return self.put(key, path.read_bytes())


class S3StandIn(ChildServer):
    """moto_server as a child process: the S3 protocol, versioning and conditional puts included."""

    def __init__(self) -> None:
        super().__init__()
        self.start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)], self.url,
                   "moto_server (the S3 stand-in)")
        import boto3

        self.client: Any = boto3.client("s3", endpoint_url=self.url, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                                        region_name=CREDENTIALS["AWS_REGION"])

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment a client (obstore, pyiceberg, DuckDB, a `batchline` process) needs."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint or self.url}

    def bucket(self, name: str | None = None, *, versioned: bool = False) -> S3Bucket:
        """A new bucket, named `name` or a fresh name."""
        name = name or self.fresh_name()
        self.client.create_bucket(Bucket=name)
        if versioned:
            self.client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
        return S3Bucket(name, versioned, self)


@dataclass
class S3Bucket(Bucket):
    standin: S3StandIn | None = None
    scheme: ClassVar[str] = "s3"

    @property
    def client(self) -> Any:
        assert self.standin is not None
        return self.standin.client

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)
        return self.url(key)

    def get(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.name, Key=key)["Body"].read())

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def versions(self, key: str) -> list[str]:
        listed = self.client.list_object_versions(Bucket=self.name, Prefix=key)
        return [v["VersionId"] for v in listed.get("Versions", []) if v["Key"] == key]

    def delete_version(self, key: str, version: str) -> None:
        self.client.delete_object(Bucket=self.name, Key=key, VersionId=version)
