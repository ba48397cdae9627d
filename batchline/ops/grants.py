"""Narrow credentials for workers: a PostgreSQL role bound to one job version.

A worker on a shared node holds the store's credentials, so what those
credentials allow is what a compromised or buggy worker can do. The role made
here can claim and renew its version's shards, insert results, dead letters,
attempts and events for that version, seal it when its last shard
completes, and halt it when its dead letters pass its bound; nothing else
(resuming a halted version is the owner's). It cannot update or delete a result, publish (the
`pointers`, `publications` and `validations` tables are closed to it), write
a planned record (it reads its own version's, where the store holds its input:
a job over a published job), or see any row of another version: every table that holds
many jobs has row-level security, and the policies made here admit this role
to this version's rows only. What it inserts as an outcome and how it changes a
shard are held by the database's fences (batchline.store.rights: a shard it
leases, at that epoch, with the lease's key, a record of that shard's slice, a
version still open), and it never says who reads a result: readers read each
record's ACL from the plan. The store's owner is not subject to row-level
security or the fences and keeps doing planning, validation and publication.

What the database cannot guard (the input snapshot, the model weights) is
printed as the read access the worker needs, to be granted where they live.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from batchline.errors import BatchlineError, StoreError
from batchline.store import postgres_sql as q
from batchline.store import require_job, rights
from batchline.store.postgres import WORKER_SESSION_SETTINGS, redact

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


@dataclass(frozen=True)
class Scope:
    """Whose rows a worker role may touch: one version's, or (`name`) every version of one job's
    name, planned now or later (a scheduled run plans a new version each night, and its worker
    slots hold a credential made before it)."""

    version: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        from batchline.spec.model import NAME_PATTERN

        if (self.version is None) == (self.name is None):
            raise BatchlineError("give a VERSION or --name NAME: the role is bound to one version or one job's name")
        if self.name is not None and not NAME_PATTERN.fullmatch(self.name):
            raise BatchlineError(f"--name {self.name!r} is not a job name (lower-case letters, digits, '-' or '_', "
                                 "starting with a letter)")

    def predicate(self) -> sql.Composed:
        # A version is NAME@DIGEST and a name holds no '@': the prefix names the job's versions alone.
        if self.name is not None:
            return sql.SQL("starts_with(version, {})").format(sql.Literal(f"{self.name}@"))
        return sql.SQL("version = {}").format(sql.Literal(self.version))

    def describe(self) -> str:
        return f"every version of {self.name}" if self.name is not None else str(self.version)

    @property
    def key(self) -> str:
        return f"name:{self.name}" if self.name is not None else str(self.version)


def role_name(scope: str) -> str:
    # Role names are at most 63 bytes and versions are free text: name by digest.
    return f"batchline_worker_{hashlib.sha256(scope.encode()).hexdigest()[:16]}"


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


def statements(scope: Scope, role: str, schema: str, *, role_exists: bool,
               password: str | None) -> list[sql.Composed]:
    """Idempotent: run again, it leaves the same role, rights and policies."""
    r = sql.Identifier(role)
    s = sql.Identifier(schema)
    mine = scope.predicate()
    out: list[sql.Composed] = []
    options: sql.Composable = sql.SQL("LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT")
    if password is not None:
        options = sql.SQL("{} PASSWORD {}").format(options, sql.Literal(password))
    out.append(sql.SQL("{} ROLE {} {}").format(sql.SQL("ALTER" if role_exists else "CREATE"), r, options))
    # The worker's session settings on the role itself too: a pooler in front of the server may
    # refuse them as a connection's startup parameter, and the role's own apply however it connects.
    for setting, value in WORKER_SESSION_SETTINGS.items():
        out.append(sql.SQL("ALTER ROLE {} SET {} = {}").format(r, sql.Identifier(setting), sql.Literal(value)))
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
        using, check = rights.POLICY_OVERRIDES.get((right.table, right.privilege), (
            "{mine}" if right.privilege != "INSERT" else None,
            "{mine}" if right.privilege != "SELECT" else None))
        name = sql.Identifier(_policy_name(role, right.table, right.privilege))
        out.append(sql.SQL("DROP POLICY IF EXISTS {} ON {}").format(name, table))
        clauses: list[sql.Composable] = []
        if using is not None:
            clauses.append(sql.SQL("USING ({})").format(sql.SQL(using).format(mine=mine)))
        if check is not None:
            clauses.append(sql.SQL("WITH CHECK ({})").format(sql.SQL(check).format(mine=mine)))
        out.append(sql.SQL("CREATE POLICY {} ON {} FOR {} TO {} {}").format(
            name, table, sql.SQL(right.privilege), r, sql.SQL(" ").join(clauses)))
    return out


def snapshot_access(spec: dict[str, Any]) -> list[str]:
    """What the worker must be able to read outside the database, and how to grant it, as
    each source family says for the locations it opens (the input snapshot, however a
    glob or manifest named it, and the weights) and for its own input keys (a table's
    snapshot); and what publishing needs of each target the output names."""
    from batchline import sources, targets
    from batchline.registry import ENGINES

    wanted: dict[str, list[str]] = {}
    paths = spec.get("input", {}).get("path", [])
    wanted["input snapshot"] = [str(p) for p in ([paths] if isinstance(paths, str) else paths)]
    model = spec.get("model", {})
    model_path = model.get("path")
    entry = ENGINES.get(str(model.get("engine")))
    if model_path and not (entry is not None and entry.remote) and not str(model_path).startswith("pkg:"):
        wanted["model weights"] = [str(model_path)]
    lines: list[str] = []
    for family in sources.families():
        if isinstance(family, sources.LocationFamily):
            for what, locations in wanted.items():
                mine = [loc for loc in locations if sources.location_family(loc) is family]
                if mine:
                    lines.extend(family.location_access(mine, what))
    for family in sources.families():
        lines.extend(family.access(spec.get("input", {})))
    for target in targets.families():
        lines.extend(target.access(spec.get("output", {})))
    return lines


def grant(store_url: str, version: str | None = None, *, name: str | None = None, role: str | None = None,
          dry_run: bool = False, password_env: str | None = None) -> GrantPlan:
    """The worker role for one version, or (`name`) for every version of one job's name."""
    if not store_url.startswith(("postgresql://", "postgres://")):
        raise BatchlineError("grants needs a PostgreSQL store (--store postgresql://...): a SQLite file "
                             "can only be guarded by the file's own permissions")
    scope = Scope(version, name)
    role = role or role_name(scope.key)
    password = None
    if password_env:
        password = os.environ.get(password_env)
        if password is None:
            raise BatchlineError(f"--password-env names {password_env}, which is not set")
    from batchline.store.postgres import PostgresStore

    # Opening the store as its owner also brings the schema (and row-level security) up to date.
    store = PostgresStore(store_url)
    try:
        if version is not None:
            spec: dict[str, Any] | None = require_job(store, version).spec
        else:
            # What outside the database its workers need is what the latest version of the name needs.
            named = [j for j in store.jobs() if j.name == name]
            spec = named[-1].spec if named else None
    finally:
        store.close()
    try:
        with psycopg.connect(store_url, autocommit=True) as conn:
            exists = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %s)", (role,)).fetchone()
            role_exists = bool(exists and exists[0])
            schema_row = conn.execute("SELECT current_schema()").fetchone()
            schema = str(schema_row[0]) if schema_row and schema_row[0] else "public"
            todo = statements(scope, role, schema, role_exists=role_exists, password=password)
            shown = [s.as_string(conn) for s in statements(scope, role, schema, role_exists=role_exists,
                                                           password="********" if password else None)]
            access = snapshot_access(spec) if spec is not None else [
                f"no version of {name} is planned yet: its input snapshot, weights and staging prefix, as "
                "`batchline grants VERSION --dry-run` prints them for a planned version"]
            plan = GrantPlan(scope.describe(), role, shown, access)
            if not dry_run:
                with conn.transaction():
                    for statement in todo:
                        conn.execute(statement)
                plan.created = True
    except psycopg.Error as exc:
        raise StoreError(f"grants on {redact(store_url)}: {str(exc).strip().splitlines()[0]}") from None
    return plan
