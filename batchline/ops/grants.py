"""Narrow credentials for workers: a PostgreSQL role bound to one job version.

A worker on a shared node holds the store's credentials, so what those
credentials allow is what a compromised or buggy worker can do. The role made
here can claim and renew its version's shards, insert results, dead letters,
attempts and events for that version, and seal it when its last shard
completes; nothing else. It cannot update or delete a result, publish (the
`pointers`, `publications` and `validations` tables are closed to it), read
the planned records, or see any row of another version: every table that holds
many jobs has row-level security, and the policies made here admit this role
to this version's rows only. The store's owner is not subject to row-level
security and keeps doing planning, validation and publication.

What the database cannot guard (the input snapshot, the model weights) is
printed as the read access the worker needs, to be granted where they live.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from batchline.errors import BatchlineError, StoreError
from batchline.store import postgres_sql as q
from batchline.store.postgres import redact

# Row-level security admits the role to its version's rows only. Where a
# command needs more than `version = {v}`, it is said here: sealing is the one
# change a worker makes to its job (from ready to sealed), and a worker cannot
# forge a carried result. {v} is the version as a literal.
_POLICY_OVERRIDES: dict[tuple[str, str], tuple[str | None, str | None]] = {
    ("jobs", "UPDATE"): ("version = {v} AND state = 'ready'", "version = {v} AND state IN ('ready', 'sealed')"),
    ("results", "INSERT"): (None, "version = {v} AND origin IS NULL"),
}
# Tables without a version column that every worker reads: the schema version and the test clock.
_UNVERSIONED = ("schema_migrations", "clock")


@dataclass(frozen=True)
class TableRight:
    table: str
    privilege: str  # SELECT | INSERT | UPDATE
    columns: tuple[str, ...]  # UPDATE only


def worker_rights() -> list[TableRight]:
    """The union of what every statement a worker runs declares it needs
    (`postgres_sql.WorkerStatement`), one right per table and privilege."""
    wanted: dict[tuple[str, str], set[str]] = {("schema_migrations", "SELECT"): set()}
    for statement in q.worker_statements().values():
        for access in statement.access:
            wanted.setdefault((access.table, access.privilege), set()).update(access.columns)
    return [TableRight(table, privilege, tuple(sorted(columns)))
            for (table, privilege), columns in sorted(wanted.items())]


def role_name(version: str) -> str:
    # Role names are at most 63 bytes and versions are free text: name by digest.
    return f"batchline_worker_{hashlib.sha256(version.encode()).hexdigest()[:16]}"


@dataclass
class GrantPlan:
    version: str
    role: str
    statements: list[str]
    access: list[str] = field(default_factory=list)
    created: bool = False


def _policy_name(role: str, table: str, command: str) -> str:
    # Short whatever the role's name, so PostgreSQL never truncates two policies to one name.
    return f"bl_{hashlib.sha256(role.encode()).hexdigest()[:12]}_{table}_{command.lower()}"


def statements(version: str, role: str, schema: str, *, role_exists: bool,
               password: str | None) -> list[sql.Composed]:
    """Idempotent: run again, it leaves the same role, rights and policies."""
    r = sql.Identifier(role)
    s = sql.Identifier(schema)
    v = sql.Literal(version)
    out: list[sql.Composed] = []
    options: sql.Composable = sql.SQL("LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT")
    if password is not None:
        options = sql.SQL("{} PASSWORD {}").format(options, sql.Literal(password))
    out.append(sql.SQL("{} ROLE {} {}").format(sql.SQL("ALTER" if role_exists else "CREATE"), r, options))
    # Start from nothing, so a re-run after a change of this file removes what was dropped from it.
    out.append(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(s, r))
    out.append(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
    for right in worker_rights():
        table = sql.Identifier(right.table)
        privilege: sql.Composable = sql.SQL(right.privilege)
        if right.columns:
            privilege = sql.SQL("{} ({})").format(privilege, sql.SQL(", ").join(map(sql.Identifier, right.columns)))
        out.append(sql.SQL("GRANT {} ON {} TO {}").format(privilege, table, r))
        if right.table in _UNVERSIONED:
            continue
        using, check = _POLICY_OVERRIDES.get((right.table, right.privilege), (
            "version = {v}" if right.privilege != "INSERT" else None,
            "version = {v}" if right.privilege != "SELECT" else None))
        name = sql.Identifier(_policy_name(role, right.table, right.privilege))
        out.append(sql.SQL("DROP POLICY IF EXISTS {} ON {}").format(name, table))
        clauses: list[sql.Composable] = []
        if using is not None:
            clauses.append(sql.SQL("USING ({})").format(sql.SQL(using).format(v=v)))
        if check is not None:
            clauses.append(sql.SQL("WITH CHECK ({})").format(sql.SQL(check).format(v=v)))
        out.append(sql.SQL("CREATE POLICY {} ON {} FOR {} TO {} {}").format(
            name, table, sql.SQL(right.privilege), r, sql.SQL(" ").join(clauses)))
    return out


def snapshot_access(spec: dict[str, Any]) -> list[str]:
    """What the worker must be able to read outside the database, and how to grant it: local
    paths one by one; objects (inputs, however a glob or manifest named them, and weights)
    as one read-only policy per bucket over the prefix they share; for Iceberg tables,
    also the catalog rights the planner and the publisher need."""
    lines: list[str] = []
    objects: dict[tuple[str, str, str], list[str]] = {}  # (scheme, bucket, what) -> keys
    paths = spec.get("input", {}).get("path", [])
    wanted = [(str(p), "input snapshot") for p in ([paths] if isinstance(paths, str) else paths)]
    model_path = spec.get("model", {}).get("path")
    if model_path and not str(model_path).startswith(("http://", "https://", "pkg:")):
        wanted.append((str(model_path), "model weights"))
    for path, what in wanted:
        if path.startswith(("s3://", "gs://")):
            scheme, _, rest = path.partition("://")
            bucket, _, key = rest.partition("/")
            objects.setdefault((scheme, bucket, what), []).append(key)
        else:
            lines.append(f"{what} {path}: the database cannot guard it; mount it read-only into the worker "
                         f"(a volume of its own, not a host path shared with other workloads), readable by the "
                         f"worker's user and writable by no worker")
    for (scheme, bucket, what), keys in objects.items():
        lines.append(_bucket_access(scheme, bucket, what, keys))
    return lines + _table_access(spec)


def _table_access(spec: dict[str, Any]) -> list[str]:
    lines = []
    table = spec.get("input", {}).get("table")
    if table:
        lines.append(
            f"input table {table['name']} (catalog {table['catalog']!r}, snapshot {table.get('snapshot_id')}): the "
            "worker needs no catalog right, only read access to the snapshot's data files, which its shards name "
            "(the table's data/ folder or prefix: s3:GetObject and s3:GetObjectVersion on it for a warehouse in "
            "S3); the planner loads the table from the catalog and reads its manifests")
    output = spec.get("output", {}).get("table")
    if output:
        sql = output["catalog"] == "store" or not str(output.get("uri", "")).startswith(("http://", "https://"))
        rights = ("SELECT, INSERT, UPDATE and DELETE on the catalog's tables iceberg_tables and "
                  "iceberg_namespace_properties" + (" (in the store's database; the worker role made here has none)"
                                                    if output["catalog"] == "store" else "")
                  if sql else "the catalog's right to create, load and commit to that table")
        lines.append(
            f"output table {output['name']} (catalog {output['catalog']!r}): the worker needs nothing of it; the "
            f"publisher (publish, rollback, retention) needs {rights}, and to write and delete files under the "
            f"table's location{' in ' + output['warehouse'] if output.get('warehouse') else ''} (it writes each "
            "version's data and metadata files and deletes pruned versions' files)")
    return lines


def _bucket_access(scheme: str, bucket: str, what: str, names: list[str]) -> str:
    if len(names) == 1 and not names[0].endswith("/"):
        pattern = names[0]  # one object, exactly
    else:
        # A folder of weights, or many objects: the whole folders they share.
        shared: list[str] = []
        for segments in zip(*(n.split("/")[:-1] for n in names), strict=False):
            if len(set(segments)) > 1:
                break
            shared.append(segments[0])
        pattern = "".join(f"{s}/" for s in shared) + "*"
    prefix = pattern.removesuffix("*")
    count = "a folder of objects" if names[0].endswith("/") else (
        f"{len(names)} object{'s' if len(names) != 1 else ''}")
    head = f"{what}, {count} at {scheme}://{bucket}/{pattern}: the database cannot guard it;"
    if scheme == "s3":
        # Reads name the pinned version, which takes s3:GetObjectVersion besides s3:GetObject;
        # a model that is a folder is listed to be fetched.
        statements: list[dict[str, Any]] = [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
                                              "Resource": [f"arn:aws:s3:::{bucket}/{pattern}"]}]
        if any(k.endswith("/") for k in names):
            statements.append({"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"],
                               "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*"]}}})
        policy = {"Version": "2012-10-17", "Statement": statements}
        return f"{head} give the worker's IAM role read-only access, e.g. {json.dumps(policy, separators=(',', ':'))}"
    name = f"projects/_/buckets/{bucket}/objects/{prefix}"
    condition = f'resource.name == "{name}"' if pattern == prefix else f'resource.name.startsWith("{name}")'
    return (f"{head} give the worker's service account roles/storage.objectViewer on gs://{bucket} with the IAM "
            f"condition {condition}")


def grant(store_url: str, version: str, *, role: str | None = None, dry_run: bool = False,
          password_env: str | None = None) -> GrantPlan:
    if not store_url.startswith(("postgresql://", "postgres://")):
        raise BatchlineError("grants needs a PostgreSQL store (--store postgresql://...): a SQLite file "
                             "can only be guarded by the file's own permissions")
    role = role or role_name(version)
    password = None
    if password_env:
        password = os.environ.get(password_env)
        if password is None:
            raise BatchlineError(f"--password-env names {password_env}, which is not set")
    from batchline.store.postgres import PostgresStore

    # Opening the store as its owner also brings the schema (and row-level security) up to date.
    store = PostgresStore(store_url)
    try:
        job = store.job(version)
        if job is None:
            raise StoreError(f"no job version {version!r} in {redact(store_url)}")
        spec = job.spec
    finally:
        store.close()
    try:
        with psycopg.connect(store_url, autocommit=True) as conn:
            exists = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %s)", (role,)).fetchone()
            role_exists = bool(exists and exists[0])
            schema_row = conn.execute("SELECT current_schema()").fetchone()
            schema = str(schema_row[0]) if schema_row and schema_row[0] else "public"
            todo = statements(version, role, schema, role_exists=role_exists, password=password)
            shown = [s.as_string(conn) for s in statements(version, role, schema, role_exists=role_exists,
                                                           password="********" if password else None)]
            plan = GrantPlan(version, role, shown, snapshot_access(spec))
            if not dry_run:
                with conn.transaction():
                    for statement in todo:
                        conn.execute(statement)
                plan.created = True
    except psycopg.Error as exc:
        raise StoreError(f"grants on {redact(store_url)}: {str(exc).strip().splitlines()[0]}") from None
    return plan
