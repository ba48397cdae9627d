"""A PgBouncer of one's own (Debian's pgbouncer) in front of a PostgreSQL database, in
transaction pooling, as most deployments put one between workers and the server: for the
tests and the fleet benchmarks. It lives beside the demos (as the S3 stand-in does) so a
benchmark need not import test code; batchline itself never imports it.

    with PgBouncer("mydb", pool_size=40, clients=1200) as pooler:
        store = open_store(pooler.url, worker=True)
        pooler.restart()          # every client and server connection ends; clients reconnect
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

import psycopg

PROGRAM = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
# PgBouncer will not run as root.
AS_POSTGRES: list[str] = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def installed() -> bool:
    return os.path.exists(PROGRAM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """Transaction pooling with PgBouncer's default startup parameters (it refuses `options`);
    `pool_size` server connections at most, `clients` client connections."""

    def __init__(self, dbname: str, *, host: str = "127.0.0.1", port: int = 5432, pool_size: int = 20,
                 clients: int = 100) -> None:
        if not installed():
            raise RuntimeError("PgBouncer is not installed (Debian's pgbouncer: make pooler installs it)")
        self.dbname = dbname
        self.folder = Path(tempfile.mkdtemp(prefix="bl-pgbouncer-"))
        self.port = _free_port()
        (self.folder / "users.txt").write_text('"postgres" ""\n')
        (self.folder / "pgbouncer.ini").write_text(
            f"[databases]\n{dbname} = host={host} port={port} dbname={dbname}\n[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\nauth_type = trust\n"
            f"auth_file = {self.folder / 'users.txt'}\npool_mode = transaction\n"
            f"default_pool_size = {pool_size}\nmax_db_connections = {pool_size}\nreserve_pool_size = 0\n"
            f"max_client_conn = {clients}\nlisten_backlog = 4096\nlogfile = {self.folder / 'pgbouncer.log'}\n")
        if AS_POSTGRES:
            shutil.chown(self.folder, "postgres", "postgres")
            for f in self.folder.iterdir():
                shutil.chown(f, "postgres", "postgres")
        self.command = [*AS_POSTGRES, PROGRAM, str(self.folder / "pgbouncer.ini")]
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.dbname}"

    def available(self) -> bool:
        try:
            with psycopg.connect(self.url, connect_timeout=3, prepare_threshold=None):
                return True
        except psycopg.Error:
            return False

    def start(self, timeout: float = 30.0) -> None:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self.available():
            if time.monotonic() > deadline:
                raise RuntimeError(f"PgBouncer did not listen within {timeout:g} s")
            time.sleep(0.1)

    def restart(self) -> None:
        """Stopped and started again on its port: every client and server connection ends."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)

    def pids(self) -> list[int]:
        return [self.process.pid] if self.process is not None and self.process.poll() is None else []

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
