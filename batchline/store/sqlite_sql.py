"""All SQL of the SQLite store: numbered migrations and the named statements.

The statement names are the PostgreSQL module's (`postgres_sql.py`); the rules
that run them are in `core.py`. Parameters are named (`:v`). Lists arrive as
one JSON array parameter and are read with `json_each`, so a statement never
depends on how many ids it is given. A schema change is one new entry at the
end of `MIGRATIONS`, never an edit of an applied one.
"""

from __future__ import annotations

import re

from batchline.store import rights
from batchline.store.beats import HEARTBEAT_BOUND, HEARTBEAT_MAX_SECONDS, HEARTBEAT_MIN_SECONDS

# (number, description, SQL). Applied in order, each in the write transaction
# that records it in `meta`.
MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "shard table, results, dead letters, event log, pointers", """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clock (id INTEGER PRIMARY KEY CHECK (id = 1), offset_s REAL NOT NULL);
INSERT OR IGNORE INTO clock (id, offset_s) VALUES (1, 0);
CREATE TABLE IF NOT EXISTS jobs (
    version TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('planning', 'ready', 'sealed', 'removed')),
    spec TEXT NOT NULL,
    plan_token TEXT,
    record_count INTEGER NOT NULL DEFAULT 0,
    shard_count INTEGER NOT NULL DEFAULT 0,
    carried_count INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    sealed_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, created_at);
CREATE TABLE IF NOT EXISTS shards (
    version TEXT NOT NULL,
    shard_no INTEGER NOT NULL,
    slice TEXT NOT NULL,
    record_count INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('ready', 'leased', 'done', 'submitted')),
    owner TEXT,
    epoch INTEGER NOT NULL DEFAULT 0,
    lease_expires REAL,
    claims INTEGER NOT NULL DEFAULT 0,
    results_count INTEGER NOT NULL DEFAULT 0,
    dead_count INTEGER NOT NULL DEFAULT 0,
    done_at REAL,
    PRIMARY KEY (version, shard_no)
);
CREATE INDEX IF NOT EXISTS shards_claimable ON shards (version, state, shard_no);
CREATE TABLE IF NOT EXISTS records (
    version TEXT NOT NULL,
    record_id TEXT NOT NULL,
    shard_no INTEGER NOT NULL,
    content_hash TEXT NOT NULL,
    PRIMARY KEY (version, record_id)
);
CREATE TABLE IF NOT EXISTS results (
    version TEXT NOT NULL,
    record_id TEXT NOT NULL,
    shard_no INTEGER NOT NULL,
    output TEXT,  -- NULL for a carried result: the row of version `origin` holds it
    origin TEXT,
    label TEXT,
    acl TEXT,
    worker TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    input_tokens INTEGER,
    output_tokens INTEGER,
    created_at REAL NOT NULL,
    PRIMARY KEY (version, record_id)
);
CREATE INDEX IF NOT EXISTS results_carried ON results (origin, record_id) WHERE origin IS NOT NULL;
CREATE TABLE IF NOT EXISTS attempts (
    version TEXT NOT NULL,
    record_id TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    last_kind TEXT NOT NULL,
    last_error TEXT NOT NULL,
    PRIMARY KEY (version, record_id)
);
CREATE TABLE IF NOT EXISTS dead_letters (
    version TEXT NOT NULL,
    record_id TEXT NOT NULL,
    shard_no INTEGER NOT NULL,
    kind TEXT NOT NULL,
    error TEXT NOT NULL,
    acl TEXT,
    attempts INTEGER NOT NULL,
    worker TEXT,
    epoch INTEGER,
    created_at REAL NOT NULL,
    PRIMARY KEY (version, record_id)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    version TEXT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    worker TEXT,
    shard_no INTEGER,
    epoch INTEGER,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_by_version ON events (version, kind, id);
CREATE TABLE IF NOT EXISTS validations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    version TEXT NOT NULL,
    passed INTEGER NOT NULL,
    report TEXT NOT NULL,
    ts REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS validations_by_version ON validations (version, id);
CREATE TABLE IF NOT EXISTS pointers (name TEXT PRIMARY KEY, version TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS publications (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    previous TEXT,
    action TEXT NOT NULL,
    who TEXT NOT NULL,
    reason TEXT,
    validation TEXT,
    ts REAL NOT NULL
);
"""),
    (2, "routes to hosted providers: a shard's route and batch, the model of each result", """
ALTER TABLE shards ADD COLUMN route TEXT NOT NULL DEFAULT 'local';
ALTER TABLE shards ADD COLUMN batch TEXT;  -- a hosted route's batch at its provider (JSON)
ALTER TABLE shards ADD COLUMN poll_at REAL;
ALTER TABLE results ADD COLUMN model TEXT;
"""),
    # Route totals and tokens read from the shards alone, so status costs the same at
    # any size; the claimer's process, so that a take-back can prove its death.
    (3, "per-shard token and carried counters, the owner's process, operation tokens on events", """
ALTER TABLE shards ADD COLUMN carried INTEGER NOT NULL DEFAULT 0;
ALTER TABLE shards ADD COLUMN input_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE shards ADD COLUMN output_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE shards ADD COLUMN owner_process TEXT;
ALTER TABLE events ADD COLUMN op TEXT;
CREATE INDEX IF NOT EXISTS events_by_op ON events (op) WHERE op IS NOT NULL;
UPDATE shards SET carried = c.carried, input_tokens = c.tin, output_tokens = c.tout
FROM (SELECT version, shard_no, SUM(origin IS NOT NULL) AS carried,
             COALESCE(SUM(CASE WHEN origin IS NULL THEN input_tokens END), 0) AS tin,
             COALESCE(SUM(CASE WHEN origin IS NULL THEN output_tokens END), 0) AS tout
      FROM results GROUP BY version, shard_no) AS c
WHERE shards.version = c.version AND shards.shard_no = c.shard_no;
"""),
    # What each publication target (a warehouse table) showed readers after a publish,
    # so the next publish changes it only from that state; a shard's pieces, so its
    # unstarted tail can be split off to another worker.
    (4, "publication targets' state, shard pieces", """
ALTER TABLE publications ADD COLUMN targets TEXT;
ALTER TABLE shards ADD COLUMN first_piece INTEGER;
ALTER TABLE shards ADD COLUMN end_piece INTEGER;
ALTER TABLE shards ADD COLUMN started_piece INTEGER;
"""),
    # A cancelled version keeps its rows (its dead letters and events say why it was
    # abandoned) until it is deleted, so it is a state of its own: 'removed' means the
    # rows are gone. SQLite cannot change a CHECK constraint in place: the table is
    # rebuilt, its rows copied as they are.
    (5, "a job state for cancelled versions", """
CREATE TABLE IF NOT EXISTS jobs_rebuilt (
    version TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('planning', 'ready', 'sealed', 'cancelled', 'removed')),
    spec TEXT NOT NULL,
    plan_token TEXT,
    record_count INTEGER NOT NULL DEFAULT 0,
    shard_count INTEGER NOT NULL DEFAULT 0,
    carried_count INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    sealed_at REAL
);
INSERT INTO jobs_rebuilt (version, name, state, spec, plan_token, record_count, shard_count, carried_count,
                          created_at, sealed_at)
SELECT version, name, state, spec, plan_token, record_count, shard_count, carried_count, created_at, sealed_at
FROM jobs;
DROP TABLE jobs;
ALTER TABLE jobs_rebuilt RENAME TO jobs;
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, created_at);
"""),
    # A scheduled run's key (its scheduled minute) names the one version it plans, so a
    # worker slot restarted later, or a second slot that saw a newer snapshot, runs that
    # version instead of planning another.
    (6, "plan keys of scheduled runs", """
CREATE TABLE IF NOT EXISTS plan_keys (
    name TEXT NOT NULL,
    key TEXT NOT NULL,
    version TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (name, key)
);
"""),
    # The engine runtime (its packages and versions) the first worker of a version loaded:
    # a worker whose engine differs refuses the version, so it never mixes engine builds.
    (7, "engine runtimes pinned per version", """
CREATE TABLE IF NOT EXISTS engine_runtimes (
    version TEXT PRIMARY KEY,
    runtime TEXT NOT NULL,
    worker TEXT NOT NULL,
    pinned_at REAL NOT NULL
);
"""),
    # A version whose dead letters pass its bound is halted for every worker until it is
    # resumed or cancelled. The bound is the store's (the spec's at planning, or the one
    # `resume` was given), and the planner's own dead letters are counted once, so the
    # outcomes a version computed are read from the shards' counters alone. SQLite cannot
    # change a CHECK constraint in place: the table is rebuilt, its rows copied as they are.
    (8, "a job state for halted versions, with their dead-letter bound", """
CREATE TABLE IF NOT EXISTS jobs_rebuilt (
    version TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('planning', 'ready', 'halted', 'sealed', 'cancelled', 'removed')),
    spec TEXT NOT NULL,
    plan_token TEXT,
    record_count INTEGER NOT NULL DEFAULT 0,
    shard_count INTEGER NOT NULL DEFAULT 0,
    carried_count INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    sealed_at REAL,
    planned_dead INTEGER NOT NULL DEFAULT 0,
    abort_rate REAL,
    abort_min INTEGER,
    halt TEXT
);
INSERT INTO jobs_rebuilt (version, name, state, spec, plan_token, record_count, shard_count, carried_count,
                          created_at, sealed_at, planned_dead)
SELECT version, name, state, spec, plan_token, record_count, shard_count, carried_count, created_at, sealed_at,
       (SELECT COUNT(*) FROM dead_letters d WHERE d.version = jobs.version AND d.worker IS NULL)
FROM jobs;
DROP TABLE jobs;
ALTER TABLE jobs_rebuilt RENAME TO jobs;
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, created_at);
"""),
    # A job over a published job reads its input from the store: planning copies each
    # upstream record's chosen text and ACL into the downstream's own records, at their
    # position in its input order, so a worker reads its shard from its own version alone.
    (9, "records hold the text, ACL and position of an input read from the store", """
ALTER TABLE records ADD COLUMN text TEXT;
ALTER TABLE records ADD COLUMN acl TEXT;
ALTER TABLE records ADD COLUMN position INTEGER;
CREATE INDEX IF NOT EXISTS records_by_position ON records (version, position) WHERE position IS NOT NULL;
"""),
    # Status counts the outcomes workers wrote within its window, so its rate moves
    # while a shard is under way rather than only as whole shards complete. The column
    # of each index's condition is in it too: SQLite reads the table to test it otherwise.
    (10, "outcomes by the time they were written", """
CREATE INDEX IF NOT EXISTS results_written ON results (version, created_at, origin) WHERE origin IS NULL;
CREATE INDEX IF NOT EXISTS dead_letters_written ON dead_letters (version, created_at, worker)
    WHERE worker IS NOT NULL;
"""),
    # output.carry's input fields, read at planning into each planned record (JSON text): a
    # result or dead letter is read with its record's, so a result carried from a base version
    # gets this version's values, and a worker never writes or reads them.
    (11, "carried input fields of planned records", """
ALTER TABLE records ADD COLUMN carry TEXT;
"""),
    # What the prompt reads of a record (its text and class, not its ACL), hashed apart from
    # its content hash: an incremental plan carries the result of a record whose ACL alone
    # changed, under its new ACL, without inference.
    (12, "the hash of a planned record's text apart from its ACL", """
ALTER TABLE records ADD COLUMN text_hash TEXT;
"""),
    # Paid workers a pacer bought to hold a version's deadline, one row per start of a slot
    # (paid-0, paid-1, ...): the slot's generation is what makes a second start of a slot that
    # runs "already there", and the rows are the store's own record of the paid worker time.
    (13, "paid workers: slots, their starts and their worker time", """
CREATE TABLE IF NOT EXISTS paid_workers (
    version TEXT NOT NULL,
    slot TEXT NOT NULL,
    generation INTEGER NOT NULL,
    launched_at REAL NOT NULL,
    launched_by TEXT NOT NULL,
    cost_per_hour REAL NOT NULL,
    worker TEXT,
    process TEXT,
    started_at REAL,
    seen_at REAL,
    claimed_at REAL,
    stopped_at REAL,
    stop_reason TEXT,
    PRIMARY KEY (version, slot, generation)
);
"""),
    # What OpenLineage is told of each version: its state changes, written in the transaction
    # that makes each (batchline.store.lineage), and the attempt of its computation (one more
    # per resume of a halted version). A version that was claimed before is taken as started.
    (14, "the lineage outbox, and the run attempt of each version", """
ALTER TABLE jobs ADD COLUMN run_attempt INTEGER NOT NULL DEFAULT 1;
ALTER TABLE jobs ADD COLUMN run_started_at REAL;
UPDATE jobs SET run_started_at = (SELECT MIN(ts) FROM events e WHERE e.version = jobs.version AND e.kind = 'claim');
CREATE TABLE IF NOT EXISTS lineage_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    version TEXT NOT NULL,
    kind TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    at REAL NOT NULL,
    detail TEXT,
    dedupe TEXT UNIQUE,
    tries INTEGER NOT NULL DEFAULT 0,
    next_try_at REAL NOT NULL,
    claimed_by TEXT,
    claimed_until REAL,
    sent_at REAL,
    given_up_at REAL,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS lineage_outbox_due ON lineage_outbox (next_try_at)
    WHERE sent_at IS NULL AND given_up_at IS NULL;
"""),
    # A version's outcomes read a shard at a time (a target writes a file per shard, a worker its
    # shard's file), and the file a worker wrote of its shard, recorded as it completes it.
    (15, "outcomes by shard, and the files of a shard", """
CREATE INDEX IF NOT EXISTS results_by_shard ON results (version, shard_no);
CREATE INDEX IF NOT EXISTS dead_letters_by_shard ON dead_letters (version, shard_no);
ALTER TABLE shards ADD COLUMN files TEXT;
"""),
    # When a version's run started: set once, by the first runner, launcher or pacer that opens
    # it for work, and kept across resumes (run_started_at is lineage's, one per attempt). A
    # deadline's window and the pacing line count from it. A version claimed before counts
    # from its first claim.
    (16, "the run start of each version", """
ALTER TABLE jobs ADD COLUMN opened_at REAL;
UPDATE jobs SET opened_at = (SELECT MIN(ts) FROM events e WHERE e.version = jobs.version AND e.kind = 'claim');
"""),
    # Every worker's heartbeat (batchline.store.beats), from its start (loading included) to its
    # exit: the capacity a pacer counts is the workers seen recently, not the owners of leases.
    (17, "worker heartbeats", """
CREATE TABLE IF NOT EXISTS worker_beats (
    version TEXT NOT NULL,
    worker TEXT NOT NULL,
    paid_slot TEXT,
    process TEXT,
    every_s REAL NOT NULL,
    started_at REAL NOT NULL,
    seen_at REAL NOT NULL,
    stopped_at REAL,
    PRIMARY KEY (version, worker)
);
CREATE INDEX IF NOT EXISTS worker_beats_live ON worker_beats (version, seen_at) WHERE stopped_at IS NULL;
"""),
    # What an orchestrator launched for a version, under its own key (batchline.store.launches):
    # a retried task finds its launch and launches nothing twice.
    (18, "launch records", """
CREATE TABLE IF NOT EXISTS launches (
    version TEXT NOT NULL,
    key TEXT NOT NULL,
    launcher TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('intent', 'launched', 'stopped')),
    by TEXT NOT NULL,
    created_at REAL NOT NULL,
    detail TEXT,
    launched_at REAL,
    stopped_at REAL,
    stop_reason TEXT,
    PRIMARY KEY (version, key)
);
"""),
    # The orchestrator's task run that launched a version: its lineage events' parent.
    (19, "the lineage parent of a version", """
ALTER TABLE jobs ADD COLUMN lineage_parent TEXT;
"""),
    # Where the input's bytes live (batchline.store.replicas): each replica's own pins, each
    # shard's home region and where it was claimed last, what each worker read across regions.
    (20, "regions: replicas, home regions, bytes across regions", """
CREATE TABLE IF NOT EXISTS replicas (
    version TEXT NOT NULL,
    region TEXT NOT NULL,
    location TEXT NOT NULL,
    root TEXT NOT NULL,
    pins TEXT NOT NULL,
    compared TEXT NOT NULL,
    by TEXT NOT NULL,
    added_at REAL NOT NULL,
    PRIMARY KEY (version, region)
);
ALTER TABLE shards ADD COLUMN home TEXT;
ALTER TABLE shards ADD COLUMN ran_in TEXT;
ALTER TABLE worker_beats ADD COLUMN region TEXT;
ALTER TABLE worker_beats ADD COLUMN cross_region_bytes INTEGER NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS shards_ready_home ON shards (version, home, shard_no) WHERE state = 'ready';
"""),
    # A heartbeat's interval is bounded as the worker's environment and PostgreSQL's migration 26
    # bound it (batchline.store.beats). SQLite adds a CHECK only to a new table: the beats are
    # copied into one, brought within the bounds, so both stores hold the same rows.
    (21, "heartbeat intervals within their bounds", f"""
CREATE TABLE worker_beats_bounded (
    version TEXT NOT NULL,
    worker TEXT NOT NULL,
    paid_slot TEXT,
    process TEXT,
    every_s REAL NOT NULL CONSTRAINT "{HEARTBEAT_BOUND}"
        CHECK (every_s >= {HEARTBEAT_MIN_SECONDS} AND every_s <= {HEARTBEAT_MAX_SECONDS}),
    started_at REAL NOT NULL,
    seen_at REAL NOT NULL,
    stopped_at REAL,
    region TEXT,
    cross_region_bytes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (version, worker)
);
INSERT INTO worker_beats_bounded (version, worker, paid_slot, process, every_s, started_at, seen_at, stopped_at,
                                  region, cross_region_bytes)
SELECT version, worker, paid_slot, process, MIN(MAX(every_s, {HEARTBEAT_MIN_SECONDS}), {HEARTBEAT_MAX_SECONDS}),
       started_at, seen_at, stopped_at, region, cross_region_bytes FROM worker_beats;
DROP TABLE worker_beats;
ALTER TABLE worker_beats_bounded RENAME TO worker_beats;
CREATE INDEX IF NOT EXISTS worker_beats_live ON worker_beats (version, seen_at) WHERE stopped_at IS NULL;
"""),
    # A worker never chooses who reads a result (batchline.store.rights), as PostgreSQL's
    # migration 27: each record's ACL kept by the plan (each distinct ACL once a version), each
    # record's piece, a lease's key (its SHA-256). Versions planned before keep the ACL their
    # records, results or dead letters held, in that order.
    (22, "ACLs kept by the plan, record pieces, lease keys", """
CREATE TABLE IF NOT EXISTS acls (
    version TEXT NOT NULL,
    acl_no INTEGER NOT NULL,
    acl TEXT NOT NULL,
    PRIMARY KEY (version, acl_no)
);
ALTER TABLE records ADD COLUMN acl_no INTEGER;
ALTER TABLE records ADD COLUMN piece INTEGER;
ALTER TABLE shards ADD COLUMN lease_key TEXT;
CREATE TEMP TABLE planned_acl AS
SELECT p.version, p.record_id, COALESCE(p.acl, r.acl, d.acl) AS acl
FROM records p
LEFT JOIN results r ON r.version = p.version AND r.record_id = p.record_id
LEFT JOIN dead_letters d ON d.version = p.version AND d.record_id = p.record_id;
INSERT INTO acls (version, acl_no, acl)
SELECT version, row_number() OVER (PARTITION BY version ORDER BY acl) - 1, acl
FROM (SELECT DISTINCT version, acl FROM planned_acl WHERE acl IS NOT NULL);
UPDATE records SET acl_no = (SELECT a.acl_no FROM planned_acl x JOIN acls a ON a.version = x.version AND a.acl = x.acl
                             WHERE x.version = records.version AND x.record_id = records.record_id);
DROP TABLE planned_acl;
ALTER TABLE records DROP COLUMN acl;
"""),
    # Who the store is, whatever its path (a file moved or copied keeps it): as PostgreSQL's
    # migration 29.
    (23, "the store's identity", """
CREATE TABLE IF NOT EXISTS store_identity (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    id TEXT NOT NULL
);
INSERT INTO store_identity (one, id) SELECT 1, lower(hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-'
    || hex(randomblob(2)) || '-' || hex(randomblob(2)) || '-' || hex(randomblob(6)));
"""),
    # Where the name's pointer was when a scheduled run first planned: as PostgreSQL's migration 30.
    (24, "the pointer a scheduled run planned from", """
ALTER TABLE plan_keys ADD COLUMN pointer_kept INTEGER NOT NULL DEFAULT 0;
ALTER TABLE plan_keys ADD COLUMN pointer_publication INTEGER;
"""),
]

SCHEMA_VERSION = MIGRATIONS[-1][0]

# Published views share the store's namespace: a job may not be named like a table of it.
RESERVED_NAMES = tuple(sorted({m.group(1) for _, _, sql in MIGRATIONS for m in re.finditer(
    r"CREATE (?:TABLE|INDEX) IF NOT EXISTS (\w+)", sql)} | {"sqlite_sequence"}))
RESERVED_PREFIX = "sqlite_"

# The database's clock, shifted by the test hook. julianday() keeps about a
# millisecond of precision, which is plenty for leases of seconds.
NOW_EXPR = "((julianday('now') - 2440587.5) * 86400.0 + (SELECT offset_s FROM clock WHERE id = 1))"
LEASE_SECONDS = "(SELECT json_extract(spec, '$.shards.lease_seconds') FROM jobs WHERE version = :v)"
OPEN_STATES = "('ready', 'leased', 'submitted')"
FENCE = "version = :v AND shard_no = :s AND owner = :w AND epoch = :e AND state = 'leased'"
# A write by the lease's holder (batchline.store.rights): the hash of the key it presents.
HELD = f"{FENCE} AND lease_key = :kh"
# An outcome is written only while its version is open (sealed, halted or cancelled refuse it).
_OPEN_JOB = "EXISTS (SELECT 1 FROM jobs WHERE version = :v AND state = 'ready')"
ROUTES = "(:routes IS NULL OR route IN (SELECT value FROM json_each(:routes)))"
S_ROUTES = "(:routes IS NULL OR s.route IN (SELECT value FROM json_each(:routes)))"
IDS = "(SELECT value FROM json_each(:ids))"

# --- clock ------------------------------------------------------------------------------

NOW = f"SELECT {NOW_EXPR}"
STORE_IDENTITY = "SELECT id FROM store_identity"
SHIFT_CLOCK = "UPDATE clock SET offset_s = offset_s + :seconds WHERE id = 1"

# --- events -----------------------------------------------------------------------------

INSERT_EVENT = (f"INSERT INTO events (version, ts, kind, worker, shard_no, epoch, detail, op) "
                f"VALUES (:v, {NOW_EXPR}, :kind, :w, :s, :e, :detail, :op)")
EVENTS_BY_OP = "SELECT kind, version, shard_no, epoch, detail FROM events WHERE op = :op ORDER BY id"
_EVENT_COLUMNS = "SELECT id, version, ts, kind, worker, shard_no, epoch, detail FROM events"
_KINDS = "(:kinds IS NULL OR kind IN (SELECT value FROM json_each(:kinds)))"
EVENTS = f"{_EVENT_COLUMNS} WHERE version = :v AND {_KINDS} ORDER BY id"
ALL_EVENTS = f"{_EVENT_COLUMNS} WHERE {_KINDS} ORDER BY id"

# --- jobs and planning ------------------------------------------------------------------

_JOB_COLUMNS = ("version, name, state, spec, record_count, shard_count, created_at, sealed_at, carried_count, "
                "abort_rate, abort_min, halt, planned_dead, opened_at")
JOB = f"SELECT {_JOB_COLUMNS} FROM jobs WHERE version = :v"
NO_JOBS = "SELECT NOT EXISTS (SELECT 1 FROM jobs)"
JOBS = (f"SELECT {_JOB_COLUMNS} FROM jobs WHERE state IN ('ready', 'halted', 'sealed', 'cancelled') "
        f"ORDER BY created_at")
# Every write transaction is BEGIN IMMEDIATE: planners, publishers and completions
# are serialised by the database lock itself.
PLAN_LOCK = "SELECT :key"
LOCK_JOB = "SELECT 1 FROM jobs WHERE version = :v"
JOB_STATE_FOR_UPDATE = "SELECT state FROM jobs WHERE version = :v"
INSERT_JOB = (f"INSERT INTO jobs (version, name, state, spec, plan_token, created_at) "
              f"VALUES (:v, :name, 'planning', :spec, :token, {NOW_EXPR})")
DELETE_PLANNING = tuple(f"DELETE FROM {table} WHERE version = :v" for table in (
    "shards", "records", "acls", "results", "attempts", "dead_letters", "events", "jobs"))
PLAN_TOKEN = "SELECT plan_token FROM jobs WHERE version = :v AND state = 'planning'"
PLAN_TOKEN_ANY = "SELECT plan_token FROM jobs WHERE version = :v"
INSERT_SHARD = ("INSERT INTO shards (version, shard_no, slice, record_count, state, route, first_piece, end_piece, "
                "home) VALUES (:v, :s, :slice, :n, 'ready', :route, :first, :end, :home)")
INSERT_RECORD = ("INSERT INTO records (version, record_id, shard_no, content_hash, carry, text_hash, acl_no, piece) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
INSERT_RECORD_WITH_INPUT = ("INSERT INTO records (version, record_id, shard_no, content_hash, carry, text_hash, acl_no, "
                            "piece, text, position) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
INSERT_ACL = "INSERT INTO acls (version, acl_no, acl) VALUES (:v, :n, :acl)"
RECORD_SHARD = "SELECT shard_no FROM records WHERE version = :v AND record_id = :r"
PLAN_DEAD_LETTER = (f"INSERT INTO dead_letters (version, record_id, shard_no, kind, error, attempts, created_at) "
                    f"VALUES (:v, :r, :s, :kind, :error, 0, {NOW_EXPR})")
# A shard's counters move with the outcomes a worker adds, and so do its pieces started, past the
# highest piece answered (`:high`, NULL where no row says its piece): a split never moves a piece
# that has an outcome (PostgreSQL's outcome fence does the same).
_STARTED = ("started_piece = CASE WHEN :high IS NULL THEN started_piece "
            "ELSE MAX(COALESCE(started_piece, first_piece), :high) END")
BUMP_DEAD = "UPDATE shards SET dead_count = dead_count + :n WHERE version = :v AND shard_no = :s"
BUMP_WORKER_DEAD = f"UPDATE shards SET dead_count = dead_count + :n, {_STARTED} WHERE version = :v AND shard_no = :s"
# Every dead letter there is at planning is the planner's own.
COMMIT_PLAN = ("UPDATE jobs SET state = 'ready', record_count = :records, shard_count = :shards, "
               "plan_token = NULL, abort_rate = :abort_rate, abort_min = :abort_min, "
               "planned_dead = (SELECT COUNT(*) FROM dead_letters WHERE version = :v) WHERE version = :v")
SEAL = (f"UPDATE jobs SET state = 'sealed', sealed_at = {NOW_EXPR} WHERE version = :v AND state = 'ready' "
        f"AND NOT EXISTS (SELECT 1 FROM shards WHERE version = :v AND state IN {OPEN_STATES}) RETURNING version")

# An incremental plan refers to the base version's results for records whose id and
# content hash are unchanged, or whose text alone is (their ACL changed: the result takes
# the new ACL); the payload stays in the row that computed it. A record's text hash is its
# content hash where it has no ACL. A carried row keeps the time its computing attempt wrote
# it, so a downstream merge keyed on time sees only what was computed anew as new.
CARRY = """
INSERT INTO results (version, record_id, shard_no, output, origin, label, worker, epoch, attempt,
                     input_tokens, output_tokens, created_at, model)
SELECT n.version, n.record_id, n.shard_no, NULL, COALESCE(b.origin, b.version), b.label,
       'carried', 0, b.attempt, b.input_tokens, b.output_tokens, b.created_at, b.model
FROM records n
JOIN records p ON p.version = :base AND p.record_id = n.record_id
JOIN results b ON b.version = :base AND b.record_id = n.record_id
WHERE n.version = :v AND (p.content_hash = n.content_hash
                          OR COALESCE(p.text_hash, p.content_hash) = COALESCE(n.text_hash, n.content_hash))"""
SET_CARRIED = "UPDATE jobs SET carried_count = :n WHERE version = :v"
CARRY_COUNTS = """
UPDATE shards SET results_count = results_count + c.n, carried = carried + c.n
FROM (SELECT shard_no, COUNT(*) AS n FROM results WHERE version = :v AND origin IS NOT NULL
      GROUP BY shard_no) AS c
WHERE shards.version = :v AND shards.shard_no = c.shard_no"""
CARRY_DONE = (f"UPDATE shards SET state = 'done', done_at = {NOW_EXPR} WHERE version = :v "
              f"AND results_count + dead_count = record_count")

# --- leases -----------------------------------------------------------------------------

READY_JOBS = "SELECT version FROM jobs WHERE state = 'ready' ORDER BY created_at"
OPEN_VERSIONS = f"""
SELECT j.version FROM jobs j WHERE j.state = 'ready'
AND EXISTS (SELECT 1 FROM shards s WHERE s.version = j.version AND s.state IN {OPEN_STATES})
ORDER BY j.created_at"""

# The lowest claimable shard: one index seek per way a shard can be claimable
# (ready, lease expired, batch due to be polled) rather than one OR, which would
# sort every open shard per claim.
_SHARD_COLUMNS = "shard_no, state, owner, epoch, slice, record_count, route, batch, first_piece, end_piece, home"


def _pick(home: bool) -> str:
    where = f"version = :v AND {ROUTES}" + (" AND home = :home" if home else "")
    return f"""
SELECT c.shard_no, c.state, c.owner, c.epoch, c.slice, c.record_count, c.route, c.batch, {NOW_EXPR},
       {LEASE_SECONDS}, c.first_piece, c.end_piece, c.home FROM (
    SELECT * FROM (SELECT {_SHARD_COLUMNS} FROM shards WHERE {where} AND state = 'ready'
                   ORDER BY shard_no LIMIT 1)
    UNION ALL
    SELECT * FROM (SELECT {_SHARD_COLUMNS} FROM shards WHERE {where} AND state = 'leased'
                   AND lease_expires <= {NOW_EXPR} ORDER BY shard_no LIMIT 1)
    UNION ALL
    SELECT * FROM (SELECT {_SHARD_COLUMNS} FROM shards WHERE {where} AND state = 'submitted'
                   AND poll_at <= {NOW_EXPR} ORDER BY shard_no LIMIT 1)
) AS c
WHERE EXISTS (SELECT 1 FROM jobs WHERE version = :v AND state = 'ready')
ORDER BY c.shard_no LIMIT 1"""


PICK_SHARD = _pick(home=False)
PICK_HOME_SHARD = _pick(home=True)
GRANT_SHARD = ("UPDATE shards SET state = 'leased', owner = :w, epoch = epoch + 1, lease_expires = :expires, "
               "claims = claims + 1, owner_process = :process, ran_in = :region, lease_key = :kh "
               "WHERE version = :v AND shard_no = :s RETURNING epoch, lease_expires")
# Whether a region has a shard not done yet (ready, or leased by a worker that may yet give it up).
HOME_OPEN = (f"SELECT 1 FROM shards WHERE version = :v AND home = :home AND state IN ('ready', 'leased', 'submitted') "
             f"AND {ROUTES} LIMIT 1")
SHARD_SLICE = "SELECT slice FROM shards WHERE version = :v AND shard_no = :s"
LEASE_BY_CLAIM = ("SELECT slice, record_count, lease_expires, route, batch, first_piece, end_piece, home FROM shards "
                  "WHERE version = :v AND shard_no = :s")
# A renewal also records how far the owner has got (the first piece it has not
# started), which is where a split of its tail may begin.
RENEW = (f"UPDATE shards SET lease_expires = {NOW_EXPR} + {LEASE_SECONDS}, "
         f"started_piece = MAX(COALESCE(started_piece, first_piece), COALESCE(:started, first_piece)) "
         f"WHERE {HELD} RETURNING lease_expires, end_piece, record_count")
RELEASE = (f"UPDATE shards SET state = CASE WHEN json_extract(batch, '$.batch_id') IS NOT NULL "
           f"THEN 'submitted' ELSE 'ready' END, owner = NULL, lease_expires = NULL, poll_at = {NOW_EXPR} "
           f"WHERE {HELD}")
SET_BATCH = f"UPDATE shards SET batch = :batch WHERE {HELD}"
SHARD_FOR_AWAIT = "SELECT state, owner, epoch, batch FROM shards WHERE version = :v AND shard_no = :s"
AWAIT_PROVIDER = (f"UPDATE shards SET state = 'submitted', batch = :batch, lease_expires = NULL, "
                  f"poll_at = {NOW_EXPR} + :poll_in WHERE {HELD}")
SHARD_FOR_COMPLETE = ("SELECT state, owner, epoch, record_count, results_count, dead_count FROM shards "
                      "WHERE version = :v AND shard_no = :s")
FINISH_SHARD = (f"UPDATE shards SET state = 'done', done_at = {NOW_EXPR}, lease_expires = NULL, files = :files "
                f"WHERE {HELD}")
_OPEN_OF_READY = (f"SELECT 1 FROM shards s JOIN jobs j ON j.version = s.version WHERE j.state = 'ready' "
                  f"AND s.state IN {OPEN_STATES} AND {S_ROUTES}")
HAS_OPEN = f"SELECT EXISTS ({_OPEN_OF_READY})"
HAS_OPEN_VERSION = f"SELECT EXISTS ({_OPEN_OF_READY} AND s.version = :v)"

# --- halting on dead letters --------------------------------------------------------------

JOB_HALT = "SELECT state, halt FROM jobs WHERE version = :v"
# The version's bound and the outcomes it computed: results less those carried, dead
# letters less the planner's.
DEAD_LETTER_FIGURES = """
SELECT j.state, j.abort_rate, j.abort_min,
       (SELECT COALESCE(SUM(results_count - carried), 0) FROM shards WHERE version = :v),
       (SELECT COALESCE(SUM(dead_count), 0) FROM shards WHERE version = :v) - j.planned_dead
FROM jobs j WHERE j.version = :v"""
DOMINANT_DEAD_KIND = """
SELECT kind, COUNT(*), MIN(record_id) FROM dead_letters WHERE version = :v AND worker IS NOT NULL
GROUP BY kind ORDER BY COUNT(*) DESC, kind LIMIT 1"""
HALT_JOB = "UPDATE jobs SET state = 'halted', halt = :halt WHERE version = :v AND state = 'ready'"
RESUME_JOB = ("UPDATE jobs SET state = 'ready', halt = NULL, abort_rate = :abort_rate, abort_min = :abort_min "
              "WHERE version = :v AND state = 'halted'")

# --- records ----------------------------------------------------------------------------

ANSWERED = (f"SELECT record_id FROM results WHERE version = :v AND record_id IN {IDS} UNION ALL "
            f"SELECT record_id FROM dead_letters WHERE version = :v AND record_id IN {IDS}")
# A shard's input where the store holds it (a job over a published job), by position.
INPUT_RECORDS = ("SELECT p.record_id, p.text, a.acl, p.content_hash, p.position FROM records p "
                 "LEFT JOIN acls a ON a.version = p.version AND a.acl_no = p.acl_no WHERE p.version = :v "
                 "AND position >= :start AND position < :end ORDER BY position")
ATTEMPTS = f"SELECT record_id, attempts FROM attempts WHERE version = :v AND record_id IN {IDS}"
FENCE_LOCK = f"SELECT first_piece, end_piece, {_OPEN_JOB} FROM shards WHERE {HELD}"
LEASE_HOLDERS = ("SELECT shard_no, owner, epoch, lease_expires, owner_process FROM shards "
                 "WHERE version = :v AND state = 'leased' ORDER BY shard_no")
TAKE_BACK = (f"UPDATE shards SET state = CASE WHEN json_extract(batch, '$.batch_id') IS NOT NULL "
             f"THEN 'submitted' ELSE 'ready' END, owner = NULL, epoch = epoch + 1, lease_expires = NULL, "
             f"poll_at = {NOW_EXPR} WHERE {FENCE}")
# The leased local shard with the longest unstarted tail, whose owner's lease is current. A
# shard holding results carried from a base version is not split: which of its pieces the
# carried results are in is not kept, so the tail's count of outcomes could not move with it.
SPLIT_CANDIDATE = f"""
SELECT shard_no, owner, epoch, slice, first_piece, end_piece, started_piece, home FROM shards
WHERE version = :v AND state = 'leased' AND route = 'local' AND end_piece IS NOT NULL
  AND lease_expires > {NOW_EXPR} AND carried = 0
ORDER BY end_piece - MAX(COALESCE(started_piece, first_piece), first_piece) DESC, shard_no LIMIT 1"""
NEXT_SHARD_NO = "SELECT COALESCE(MAX(shard_no), -1) + 1 FROM shards WHERE version = :v"
SHRINK_SHARD = ("UPDATE shards SET end_piece = :end, record_count = record_count - :records, "
                "dead_count = dead_count - :dead WHERE version = :v AND shard_no = :s AND end_piece = :old_end")
SPLIT_SHARD = ("INSERT INTO shards (version, shard_no, slice, record_count, state, route, dead_count, first_piece, "
               "end_piece, home) VALUES (:v, :new, :slice, :records, 'ready', 'local', :dead, :first, :end, :home)")
# One row of a flush; an id already answered (a result, or a dead letter) makes the
# flush find the new rows first (see SQLiteStore._put).
PUT_RESULT = """
INSERT INTO results (version, record_id, shard_no, output, worker, epoch, attempt, input_tokens,
                     output_tokens, created_at, label, model)
SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12
WHERE NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.version = ?1 AND d.record_id = ?2)"""
BUMP_RESULTS = ("UPDATE shards SET results_count = results_count + :n, input_tokens = input_tokens + :tin, "
                f"output_tokens = output_tokens + :tout, {_STARTED} WHERE version = :v AND shard_no = :s")
# The outcomes a writer is about to add, refused by the first of batchline.store.rights'
# OUTCOME_RULES one of them breaks (SQLite has no roles: PostgreSQL's trigger, as a statement).
_REFUSAL = rights.first_refusal(rights.OUTCOME_RULES, key=":kh")
OUTCOME_REFUSAL = f"""
SELECT n.record_id, {_REFUSAL}
FROM (SELECT value AS record_id, :v AS version, :s AS shard_no, :w AS worker, :e AS epoch FROM json_each(:ids)) n
LEFT JOIN jobs j ON j.version = n.version
LEFT JOIN shards s ON s.version = n.version AND s.shard_no = n.shard_no
LEFT JOIN records p ON p.version = n.version AND p.record_id = n.record_id
WHERE {_REFUSAL} IS NOT NULL
LIMIT 1"""
INSERT_DEAD = (f"INSERT OR IGNORE INTO dead_letters (version, record_id, shard_no, kind, error, attempts, "
               f"worker, epoch, created_at) SELECT :v, :r, :s, :kind, :error, :attempts, :w, :e, "
               f"{NOW_EXPR} WHERE NOT EXISTS (SELECT 1 FROM results WHERE version = :v AND record_id = :r)")
IS_ANSWERED = ("SELECT EXISTS (SELECT 1 FROM results WHERE version = :v AND record_id = :r) "
               "OR EXISTS (SELECT 1 FROM dead_letters WHERE version = :v AND record_id = :r)")
CHARGE = ("INSERT INTO attempts (version, record_id, attempts, last_kind, last_error) "
          "VALUES (:v, :r, 1, :kind, :error) ON CONFLICT (version, record_id) DO UPDATE SET "
          "attempts = attempts + 1, last_kind = excluded.last_kind, last_error = excluded.last_error "
          "RETURNING attempts")

# --- reading ----------------------------------------------------------------------------

STATUS_SHARDS = ("SELECT state, COUNT(*), SUM(results_count), SUM(dead_count) FROM shards WHERE version = :v "
                 "GROUP BY state")
DEAD_BY_KIND = "SELECT kind, COUNT(*) FROM dead_letters WHERE version = :v GROUP BY kind"
LEASES_LOST = "SELECT COUNT(*) FROM events WHERE version = :v AND kind = 'lease_expired'"
COUNT_EVENTS = "SELECT COUNT(*) FROM events WHERE version = :v AND kind = :kind"
FIRST_CLAIM = "SELECT MIN(ts) FROM events WHERE version = :v AND kind = 'claim'"
# Outcomes computed within the window (not carried results, not the planner's dead letters).
RECENT = ("SELECT (SELECT COUNT(*) FROM results WHERE version = :v AND created_at >= :since AND origin IS NULL) "
          "+ (SELECT COUNT(*) FROM dead_letters WHERE version = :v AND created_at >= :since "
          "AND worker IS NOT NULL)")
# The newest refusal of a changed input on a shard not done that nobody has claimed since.
STOPPED_BY_INPUT = """
SELECT e.shard_no, e.detail FROM events e
JOIN shards s ON s.version = e.version AND s.shard_no = e.shard_no AND s.state <> 'done'
WHERE e.version = :v AND e.kind = 'input_changed'
  AND NOT EXISTS (SELECT 1 FROM events c WHERE c.version = e.version AND c.kind = 'claim'
                  AND c.shard_no = e.shard_no AND c.id > e.id)
ORDER BY e.id DESC LIMIT 1"""
SHARD_ROWS = ("SELECT shard_no, state, owner, epoch, lease_expires, claims, record_count, results_count, "
              "dead_count, route, json_extract(batch, '$.batch_id'), poll_at FROM shards WHERE version = :v "
              "ORDER BY shard_no")
ROUTE_TOTALS = ("SELECT route, COUNT(*), SUM(record_count), SUM(results_count), SUM(carried), SUM(dead_count), "
                "SUM(input_tokens), SUM(output_tokens) FROM shards WHERE version = :v GROUP BY route")
TOKEN_TOTALS = "SELECT SUM(input_tokens), SUM(output_tokens) FROM shards WHERE version = :v"
RESULT_HISTOGRAM = """
SELECT attempt, MIN(MAX(CAST((created_at - :start) / :width AS INTEGER), 0), :last) AS bin, COUNT(*)
FROM results WHERE version = :v AND origin IS NULL GROUP BY attempt, bin"""
RUN_THROUGHPUT = """
SELECT SUM(json_extract(c.detail, '$.records')), SUM(c.ts - k.ts) FROM events c
JOIN events k ON k.version = c.version AND k.kind = 'claim' AND k.shard_no = c.shard_no AND k.epoch = c.epoch
WHERE c.version = :v AND c.kind = 'complete'"""
# A carried result's payload lives in the row of the version that computed it.
_RESULT_COLUMNS = ("r.record_id, COALESCE(r.output, o.output), pacl.acl, r.shard_no, r.worker, r.epoch, r.attempt, "
                   "r.created_at, r.input_tokens, r.output_tokens, r.label, r.origin, r.model, o.worker, o.epoch")
# A result's ACL is its record's as the planner read it, never the one its worker put
# (batchline.store.rights): every reader joins it from the version's own plan.
_PLANNED_ACL = ("LEFT JOIN records pr ON pr.version = {t}.version AND pr.record_id = {t}.record_id "
                "LEFT JOIN acls pacl ON pacl.version = pr.version AND pacl.acl_no = pr.acl_no")
_RESULTS_FROM = ("FROM results r LEFT JOIN results o "
                 "ON r.origin IS NOT NULL AND o.version = r.origin AND o.record_id = r.record_id "
                 + _PLANNED_ACL.format(t="r"))
RESULTS_PAGE = (f"SELECT {_RESULT_COLUMNS} {_RESULTS_FROM} WHERE r.version = :v AND r.record_id > :after "
                f"ORDER BY r.record_id LIMIT :n")
COMPUTED_RESULTS_PAGE = (f"SELECT {_RESULT_COLUMNS} {_RESULTS_FROM} WHERE r.version = :v AND "
                         f"r.record_id > :after AND r.origin IS NULL ORDER BY r.record_id LIMIT :n")
# The outputs this version computed, alone: what the gate's schema check reads of every result.
COMPUTED_OUTPUTS_PAGE = ("SELECT record_id, output FROM results WHERE version = :v AND record_id > :after "
                         "AND origin IS NULL ORDER BY record_id LIMIT :n")
RESULTS_FOR = f"SELECT {_RESULT_COLUMNS} {_RESULTS_FROM} WHERE r.version = :v AND r.record_id IN {IDS}"
_DEAD_COLUMNS = "d.record_id, d.shard_no, d.kind, d.error, pacl.acl, d.attempts, d.worker, d.created_at"
_DEAD_FROM = "FROM dead_letters d " + _PLANNED_ACL.format(t="d")
_DEAD_PAGE = "WHERE d.version = :v AND d.record_id > :after ORDER BY d.record_id LIMIT :n"
DEAD_LETTERS_PAGE = f"SELECT {_DEAD_COLUMNS} {_DEAD_FROM} {_DEAD_PAGE}"
# A version with output.carry: each row with its planned record's carried fields.
_CARRY_FROM = "LEFT JOIN records c ON c.version = :v AND c.record_id = r.record_id"
RESULTS_PAGE_CARRY = (f"SELECT {_RESULT_COLUMNS}, c.carry {_RESULTS_FROM} {_CARRY_FROM} WHERE r.version = :v "
                      f"AND r.record_id > :after ORDER BY r.record_id LIMIT :n")
COMPUTED_RESULTS_PAGE_CARRY = (f"SELECT {_RESULT_COLUMNS}, c.carry {_RESULTS_FROM} {_CARRY_FROM} WHERE "
                               f"r.version = :v AND r.record_id > :after AND r.origin IS NULL "
                               f"ORDER BY r.record_id LIMIT :n")
RESULTS_FOR_CARRY = (f"SELECT {_RESULT_COLUMNS}, c.carry {_RESULTS_FROM} {_CARRY_FROM} WHERE r.version = :v "
                     f"AND r.record_id IN {IDS}")
DEAD_LETTERS_PAGE_CARRY = (f"SELECT {_DEAD_COLUMNS}, c.carry {_DEAD_FROM} LEFT JOIN records c "
                           f"ON c.version = :v AND c.record_id = d.record_id {_DEAD_PAGE}")
PLANNED_PAGE = "SELECT record_id FROM records WHERE version = :v AND record_id > :after ORDER BY record_id LIMIT :n"
RESOLVE_NAME = "SELECT version FROM pointers WHERE name = :name"
POINTERS = "SELECT name, version FROM pointers ORDER BY name"
LABEL_COUNTS = "SELECT label, COUNT(*) FROM results WHERE version = :v GROUP BY label"

# --- validation and publication ---------------------------------------------------------

COUNT_RECORDS = "SELECT COUNT(*) FROM records WHERE version = :v"
COUNT_RESULTS = "SELECT COUNT(*) FROM results WHERE version = :v"
COUNT_DEAD = "SELECT COUNT(*) FROM dead_letters WHERE version = :v"
MATCHED_RESULTS = ("SELECT COUNT(*) FROM results r JOIN records p ON p.version = r.version "
                   "AND p.record_id = r.record_id WHERE r.version = :v")
MATCHED_DEAD = ("SELECT COUNT(*) FROM dead_letters d JOIN records p ON p.version = d.version "
                "AND p.record_id = d.record_id WHERE d.version = :v")
COUNT_BOTH = ("SELECT COUNT(*) FROM dead_letters d WHERE d.version = :v AND EXISTS "
              "(SELECT 1 FROM results r WHERE r.version = :v AND r.record_id = d.record_id)")
# The counts in order: records, results, dead letters, results matched, dead letters matched, ids with both.
COVERAGE_STEPS = (COUNT_RECORDS, COUNT_RESULTS, COUNT_DEAD, MATCHED_RESULTS, MATCHED_DEAD, COUNT_BOTH)
# SQLite has no hash aggregate to prove full coverage without the joins, which are fast here.
COVERAGE_PROOF: tuple[str, ...] = ()
MISSING_SAMPLE = """
SELECT p.record_id FROM records p WHERE p.version = :v
AND NOT EXISTS (SELECT 1 FROM results r WHERE r.version = :v AND r.record_id = p.record_id)
AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.version = :v AND d.record_id = p.record_id)
ORDER BY p.record_id LIMIT :n"""
UNEXPECTED_SAMPLE = """
SELECT x.record_id FROM (SELECT record_id FROM results WHERE version = :v UNION ALL
                         SELECT record_id FROM dead_letters WHERE version = :v) x
WHERE NOT EXISTS (SELECT 1 FROM records p WHERE p.version = :v AND p.record_id = x.record_id)
ORDER BY x.record_id LIMIT :n"""
INSERT_VALIDATION = f"INSERT INTO validations (version, passed, report, ts) VALUES (:v, :passed, :report, {NOW_EXPR})"
LATEST_VALIDATION = "SELECT passed, report, ts FROM validations WHERE version = :v ORDER BY id DESC LIMIT 1"
POINTER_FOR_UPDATE = "SELECT version FROM pointers WHERE name = :name"
SET_POINTER = (f"INSERT INTO pointers (name, version, updated_at) VALUES (:name, :v, {NOW_EXPR}) "
               f"ON CONFLICT (name) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at")
# The view named after the job reads through its pointer, so a reader's one
# statement sees the whole old version or the whole new one, never a mix.
CREATE_VIEW = """
CREATE VIEW IF NOT EXISTS "{name}" AS
SELECT r.record_id AS id, COALESCE(r.output, o.output) AS output, a.acl AS acl, r.label AS label,
       r.version AS version, c.carry AS carry
FROM pointers p
JOIN results r ON r.version = p.version
LEFT JOIN results o ON r.origin IS NOT NULL AND o.version = r.origin AND o.record_id = r.record_id
LEFT JOIN records c ON c.version = r.version AND c.record_id = r.record_id
LEFT JOIN acls a ON a.version = c.version AND a.acl_no = c.acl_no
WHERE p.name = '{name}'"""
IS_VIEW = "SELECT type = 'view' FROM sqlite_master WHERE name = :name"
# A view made before it had the carry column is made again, in the publish that moves its pointer.
VIEW_WITHOUT_CARRY = ("SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'view' AND name = :name) "
                      "AND NOT EXISTS (SELECT 1 FROM pragma_table_info(:name) WHERE name = 'carry')")
DROP_VIEW = 'DROP VIEW IF EXISTS "{name}"'
INSERT_PUBLICATION = (f"INSERT INTO publications (name, version, previous, action, who, reason, validation, targets, "
                      f"ts) VALUES (:name, :v, :previous, :action, :who, :reason, :validation, :targets, {NOW_EXPR})")
# The name's latest publication: a publish or rollback refuses unless it is still the
# one its publisher read (a compare-and-set on its id, under the name's lock).
LATEST_PUBLICATION = "SELECT id, version, action, who FROM publications WHERE name = :name ORDER BY id DESC LIMIT 1"
IS_SEALED = "SELECT EXISTS (SELECT 1 FROM jobs WHERE version = :v AND state = 'sealed')"
PUBLICATIONS = ("SELECT id, name, version, previous, action, who, reason, validation, ts, targets FROM publications "
                "WHERE name = :name ORDER BY id")
IS_PUBLISHED = "SELECT EXISTS (SELECT 1 FROM pointers WHERE version = :v)"
KEY_PLAN = (f"INSERT INTO plan_keys (name, key, version, created_at, pointer_kept, pointer_publication) "
            f"VALUES (:name, :key, :v, {NOW_EXPR}, 1, (SELECT max(id) FROM publications WHERE name = :name)) "
            "ON CONFLICT (name, key) DO NOTHING")
KEYED_POINTER = "SELECT pointer_kept, pointer_publication FROM plan_keys WHERE name = :name AND key = :key"
KEYED_VERSION = "SELECT version FROM plan_keys WHERE name = :name AND key = :key"
PIN_RUNTIME = (f"INSERT INTO engine_runtimes (version, runtime, worker, pinned_at) VALUES (:v, :runtime, :w, {NOW_EXPR}) "
               "ON CONFLICT (version) DO NOTHING")
PINNED_RUNTIME = "SELECT runtime, worker FROM engine_runtimes WHERE version = :v"
# Only the spec's validate section changes: what the version computes is its hash's.
SET_GATE = "UPDATE jobs SET spec = :spec WHERE version = :v AND state IN ('ready', 'halted', 'sealed')"
CANCEL_JOB = "UPDATE jobs SET state = 'cancelled' WHERE version = :v AND state IN ('ready', 'halted', 'sealed')"
# The epoch moves on, so the owner's next renewal or write is refused and it leaves the shard.
END_LEASES = ("UPDATE shards SET state = 'ready', owner = NULL, epoch = epoch + 1, lease_expires = NULL "
              "WHERE version = :v AND state = 'leased'")
# Rows that a later version carries stay: they hold that version's payload.
REMOVE_VERSION = (
    "DELETE FROM results WHERE version = :v AND NOT EXISTS (SELECT 1 FROM results c "
    "WHERE c.origin = :v AND c.record_id = results.record_id)",
    *(f"DELETE FROM {table} WHERE version = :v" for table in (
        "shards", "records", "acls", "attempts", "dead_letters", "validations", "engine_runtimes")),
    "UPDATE jobs SET state = 'removed' WHERE version = :v",
)

# --- what changed between versions (batchline.store.changes) ------------------------------

RESULT_ACLS = (f"SELECT r.record_id, pacl.acl FROM results r {_PLANNED_ACL.format(t='r')} "
               f"WHERE r.version = :v AND r.record_id IN {IDS}")
# Two versions' planned ACLs of one record, by text (each version numbers its ACLs its own way).
_ACL_PAIR = ("LEFT JOIN records pn ON pn.version = n.version AND pn.record_id = n.record_id "
             "LEFT JOIN acls an ON an.version = pn.version AND an.acl_no = pn.acl_no "
             "LEFT JOIN records po ON po.version = o.version AND po.record_id = o.record_id "
             "LEFT JOIN acls ao ON ao.version = po.version AND ao.acl_no = po.acl_no")
# A result is the same where the same version computed it (a carried one names its origin).
RESULT_CHANGES = """
SELECT SUM(o.record_id IS NULL),
       SUM(o.record_id IS NOT NULL AND (ao.acl IS NOT an.acl
                                        OR COALESCE(n.origin, n.version) <> COALESCE(o.origin, o.version)))
FROM results n LEFT JOIN results o ON o.version = :old AND o.record_id = n.record_id
""" + _ACL_PAIR + """
WHERE n.version = :new"""
RESULTS_REMOVED = """
SELECT COUNT(*) FROM results o WHERE o.version = :old
AND NOT EXISTS (SELECT 1 FROM results n WHERE n.version = :new AND n.record_id = o.record_id)"""
# The results of :new whose row differs from :old's: new records, another result (recomputed), another
# ACL, other carried values; and the records :old has a result for and :new has none.
RESULT_ROWS_CHANGED_PAGE = """
SELECT n.record_id FROM results n
LEFT JOIN results o ON o.version = :old AND o.record_id = n.record_id
LEFT JOIN records cn ON cn.version = :new AND cn.record_id = n.record_id
LEFT JOIN records co ON co.version = :old AND co.record_id = n.record_id
LEFT JOIN acls an ON an.version = cn.version AND an.acl_no = cn.acl_no
LEFT JOIN acls ao ON ao.version = co.version AND ao.acl_no = co.acl_no
WHERE n.version = :new AND n.record_id > :after
  AND (o.record_id IS NULL OR ao.acl IS NOT an.acl OR COALESCE(n.origin, n.version) <> COALESCE(o.origin, o.version)
       OR cn.carry IS NOT co.carry)
ORDER BY n.record_id LIMIT :n"""
RESULT_ROWS_REMOVED_PAGE = """
SELECT o.record_id FROM results o WHERE o.version = :old AND o.record_id > :after
AND NOT EXISTS (SELECT 1 FROM results n WHERE n.version = :new AND n.record_id = o.record_id)
ORDER BY o.record_id LIMIT :n"""
# The rule batchline.store.changes.record_kind states for a record not planned yet.
RECORD_CHANGES_PAGE = """
SELECT n.record_id, CASE WHEN p.record_id IS NULL THEN 'new'
                         WHEN p.content_hash = n.content_hash THEN 'unchanged'
                         WHEN COALESCE(p.text_hash, p.content_hash) = COALESCE(n.text_hash, n.content_hash)
                         THEN 'acl' ELSE 'text' END
FROM records n LEFT JOIN records p ON p.version = :base AND p.record_id = n.record_id
WHERE n.version = :v AND n.record_id > :after ORDER BY n.record_id LIMIT :n"""
RECORDS_REMOVED_PAGE = """
SELECT p.record_id FROM records p WHERE p.version = :base AND p.record_id > :after
AND NOT EXISTS (SELECT 1 FROM records n WHERE n.version = :v AND n.record_id = p.record_id)
ORDER BY p.record_id LIMIT :n"""
BASE_HASHES = f"""
SELECT p.record_id, p.content_hash, p.text_hash,
       EXISTS (SELECT 1 FROM results b WHERE b.version = :v AND b.record_id = p.record_id)
FROM records p WHERE p.version = :v AND p.record_id IN {IDS}"""

# --- paid workers (batchline.store.paid) ---------------------------------------------------

_PAID_COLUMNS = ("slot, generation, launched_at, launched_by, cost_per_hour, worker, process, started_at, seen_at, "
                 "claimed_at, stopped_at, stop_reason")
PAID_SLOTS = f"SELECT {_PAID_COLUMNS} FROM paid_workers WHERE version = :v ORDER BY slot, generation"
PAID_SLOT_LATEST = (f"SELECT {_PAID_COLUMNS} FROM paid_workers WHERE version = :v AND slot = :slot "
                    f"ORDER BY generation DESC LIMIT 1")
PAID_INSERT = (f"INSERT INTO paid_workers (version, slot, generation, launched_at, launched_by, cost_per_hour) "
               f"VALUES (:v, :slot, :g, {NOW_EXPR}, :by, :cost)")
PAID_SEEN = f"""
UPDATE paid_workers SET worker = :w, process = :process, started_at = COALESCE(started_at, {NOW_EXPR}),
    seen_at = {NOW_EXPR}, claimed_at = CASE WHEN :claimed AND claimed_at IS NULL THEN {NOW_EXPR} ELSE claimed_at END
WHERE version = :v AND slot = :slot AND generation = :g AND stopped_at IS NULL AND (worker IS NULL OR worker = :w)"""
PAID_STOP = (f"UPDATE paid_workers SET stopped_at = {NOW_EXPR}, stop_reason = :reason WHERE version = :v "
             f"AND slot = :slot AND generation = :g AND stopped_at IS NULL")
# Worker-seconds from each start (the worker's process up) to its stop, or to now while it runs.
PAID_SPEND = (f"SELECT COALESCE(SUM(COALESCE(stopped_at, {NOW_EXPR}) - started_at), 0) FROM paid_workers "
              f"WHERE version = :v AND started_at IS NOT NULL")
PAID_BUDGET = (f"SELECT COALESCE(SUM((COALESCE(stopped_at, {NOW_EXPR}) - started_at) * cost_per_hour / 3600.0), 0), "
               "COALESCE(SUM(CASE WHEN stopped_at IS NULL THEN cost_per_hour ELSE 0 END), 0) "
               "FROM paid_workers WHERE version = :v AND started_at IS NOT NULL")

# --- the lineage outbox (batchline.store.lineage) ------------------------------------------

# --- worker heartbeats (batchline.store.beats) ----------------------------------------------

WORKER_BEAT = f"""
INSERT INTO worker_beats (version, worker, paid_slot, process, every_s, started_at, seen_at, region, cross_region_bytes)
SELECT :v, :w, :slot, :process, :every, {NOW_EXPR}, {NOW_EXPR}, :region, :cross
WHERE EXISTS (SELECT 1 FROM jobs WHERE version = :v)
ON CONFLICT (version, worker) DO UPDATE SET seen_at = excluded.seen_at, every_s = excluded.every_s,
    cross_region_bytes = MAX(worker_beats.cross_region_bytes, excluded.cross_region_bytes)
WHERE worker_beats.stopped_at IS NULL"""
WORKER_GONE = (f"UPDATE worker_beats SET stopped_at = {NOW_EXPR} WHERE version = :v AND worker = :w "
               "AND stopped_at IS NULL")
WORKERS_SEEN = (f"SELECT worker, paid_slot, process, every_s, started_at, seen_at FROM worker_beats "
                f"WHERE version = :v AND stopped_at IS NULL AND seen_at >= {NOW_EXPR} - :grace * every_s "
                "ORDER BY worker")
# The one rule of what a heartbeat counts for (batchline.store.beats.live_capacity), as
# PostgreSQL's statement of the same name states it.
LIVE_CAPACITY = f"""
WITH n AS (SELECT {NOW_EXPR} AS t),
leased AS (
    SELECT DISTINCT owner FROM shards
    WHERE version = :v AND state = 'leased' AND lease_expires > (SELECT t FROM n)
), completed AS (
    SELECT owner, max(done_at) AS done_at FROM shards
    WHERE version = :v AND state = 'done' AND done_at >= (SELECT t FROM n) - :grace * :max_every
    GROUP BY owner
), paid AS (
    SELECT slot || '/' || generation AS ref, worker FROM paid_workers
    WHERE version = :v AND stopped_at IS NULL AND worker IS NOT NULL
), counted AS (
    SELECT b.worker, b.paid_slot, b.process, b.every_s, b.started_at, b.seen_at,
           CASE WHEN l.owner IS NOT NULL THEN 'leased'
                WHEN c.done_at >= n.t - :grace * b.every_s THEN 'completed'
                WHEN b.started_at >= n.t - :loading THEN 'loading' END AS why
    FROM worker_beats b CROSS JOIN n
    LEFT JOIN leased l ON l.owner = b.worker
    LEFT JOIN completed c ON c.owner = b.worker
    LEFT JOIN paid p ON p.ref = b.paid_slot AND p.worker = b.worker
    WHERE b.version = :v AND b.stopped_at IS NULL AND b.seen_at >= n.t - :grace * b.every_s
      AND (b.paid_slot IS NULL OR p.ref IS NOT NULL)
)
SELECT worker, paid_slot, process, every_s, started_at, seen_at, why FROM counted
WHERE why IS NOT NULL ORDER BY worker"""
RESTART_SPANS = "SELECT claimed_at - launched_at FROM paid_workers WHERE version = :v AND claimed_at IS NOT NULL"
SPEC_RESTART_OVERHEAD = ("SELECT json_extract(spec, '$.fallback.restart_overhead_seconds') FROM jobs "
                         "WHERE version = :v")
# --- replicas and regions (batchline.store.replicas) -----------------------------------------

_REPLICA_COLUMNS = "region, location, root, pins, compared, by, added_at"
REPLICA_ADD = (f"INSERT INTO replicas (version, {_REPLICA_COLUMNS}) "
               f"VALUES (:v, :region, :location, :root, :pins, :compared, :by, {NOW_EXPR}) "
               "ON CONFLICT (version, region) DO UPDATE SET location = excluded.location, root = excluded.root, "
               "pins = excluded.pins, compared = excluded.compared, by = excluded.by, added_at = excluded.added_at")
REPLICAS = f"SELECT {_REPLICA_COLUMNS} FROM replicas WHERE version = :v ORDER BY region"
SHARD_REGIONS = ("SELECT home, ran_in, state, count(*), sum(record_count) FROM shards WHERE version = :v "
                 "GROUP BY home, ran_in, state ORDER BY home IS NOT NULL, home, ran_in IS NOT NULL, ran_in, state")
WORKER_REGIONS = "SELECT worker, region, cross_region_bytes FROM worker_beats WHERE version = :v ORDER BY worker"

# --- launch records (batchline.store.launches) ----------------------------------------------

_LAUNCH_COLUMNS = "version, key, launcher, state, by, created_at, detail, launched_at, stopped_at, stop_reason"
LAUNCH_INTENT = (f"INSERT INTO launches (version, key, launcher, state, by, created_at) "
                 f"VALUES (:v, :key, :launcher, 'intent', :by, {NOW_EXPR}) ON CONFLICT (version, key) DO UPDATE SET "
                 "launcher = excluded.launcher, state = 'intent', by = excluded.by, created_at = excluded.created_at, "
                 "detail = NULL, launched_at = NULL, stopped_at = NULL, stop_reason = NULL "
                 "WHERE launches.state = 'stopped'")
LAUNCH_ROW = f"SELECT {_LAUNCH_COLUMNS} FROM launches WHERE version = :v AND key = :key"
LAUNCH_DONE = (f"UPDATE launches SET state = 'launched', detail = :detail, launched_at = {NOW_EXPR} "
               "WHERE version = :v AND key = :key AND state <> 'stopped'")
LAUNCH_STOP = (f"UPDATE launches SET state = 'stopped', stopped_at = {NOW_EXPR}, stop_reason = :reason "
               "WHERE version = :v AND key = :key AND state <> 'stopped'")
LAUNCHES = f"SELECT {_LAUNCH_COLUMNS} FROM launches WHERE version = :v ORDER BY created_at, key"

# A version a bare worker claimed before anything opened it started at that claim.
OPEN_RUN = (f"UPDATE jobs SET opened_at = COALESCE((SELECT MIN(ts) FROM events WHERE version = :v AND kind = 'claim'), "
            f"{NOW_EXPR}) WHERE version = :v AND opened_at IS NULL")
OPENED_AT = "SELECT opened_at FROM jobs WHERE version = :v"
LINEAGE_RUN_ATTEMPT = "SELECT run_attempt, run_started_at FROM jobs WHERE version = :v"
LINEAGE_START_RUN = (f"UPDATE jobs SET run_started_at = {NOW_EXPR} WHERE version = :v AND run_started_at IS NULL "
                     f"RETURNING run_attempt")
LINEAGE_NEXT_ATTEMPT = "UPDATE jobs SET run_attempt = run_attempt + 1, run_started_at = NULL WHERE version = :v"
LINEAGE_INSERT = (f"INSERT OR IGNORE INTO lineage_outbox (version, kind, attempt, at, detail, dedupe, next_try_at) "
                  f"VALUES (:v, :kind, :attempt, {NOW_EXPR}, :detail, :dedupe, {NOW_EXPR})")
LINEAGE_FIGURES = ("SELECT COALESCE(SUM(results_count), 0), COALESCE(SUM(dead_count), 0), COALESCE(SUM(carried), 0), "
                   "COALESCE(SUM(input_tokens), 0), COALESCE(SUM(output_tokens), 0) FROM shards WHERE version = :v")
LINEAGE_DEAD_BY_KIND = "SELECT kind, COUNT(*) FROM dead_letters WHERE version = :v GROUP BY kind"
LINEAGE_PAID = (f"SELECT COALESCE(SUM(COALESCE(stopped_at, {NOW_EXPR}) - started_at), 0), "
                f"COALESCE(SUM((COALESCE(stopped_at, {NOW_EXPR}) - started_at) * cost_per_hour / 3600.0), 0) "
                "FROM paid_workers WHERE version = :v AND started_at IS NOT NULL")
_OUTBOX_COLUMNS = "id, version, kind, attempt, at, detail, tries, sent_at, given_up_at, last_error"
LINEAGE_CLAIM = f"""
UPDATE lineage_outbox SET claimed_by = :by, claimed_until = {NOW_EXPR} + :hold, tries = tries + 1
WHERE id IN (SELECT id FROM lineage_outbox
             WHERE (:v IS NULL OR version = :v) AND sent_at IS NULL AND given_up_at IS NULL
               AND next_try_at <= {NOW_EXPR} AND (claimed_until IS NULL OR claimed_until < {NOW_EXPR})
             ORDER BY id LIMIT :n)
RETURNING {_OUTBOX_COLUMNS}"""
LINEAGE_SENT = (f"UPDATE lineage_outbox SET sent_at = {NOW_EXPR}, claimed_until = NULL, last_error = NULL "
                f"WHERE id = :id AND claimed_by = :by AND sent_at IS NULL")
LINEAGE_FAILED = (f"UPDATE lineage_outbox SET last_error = :error, claimed_until = NULL, "
                  f"next_try_at = {NOW_EXPR} + :retry_in, "
                  f"given_up_at = CASE WHEN :give_up THEN {NOW_EXPR} END "
                  f"WHERE id = :id AND claimed_by = :by AND sent_at IS NULL")
LINEAGE_PARENT = "SELECT lineage_parent FROM jobs WHERE version = :v"
SET_LINEAGE_PARENT = "UPDATE jobs SET lineage_parent = :parent WHERE version = :v"
LINEAGE_ROWS = f"SELECT {_OUTBOX_COLUMNS} FROM lineage_outbox WHERE (:v IS NULL OR version = :v) ORDER BY id"
LINEAGE_RETRY = (f"UPDATE lineage_outbox SET given_up_at = NULL, tries = 0, next_try_at = {NOW_EXPR} "
                 f"WHERE (:v IS NULL OR version = :v) AND sent_at IS NULL AND given_up_at IS NOT NULL")

# --- a version's outcomes by shard (batchline.store.files) -----------------------------------

SHARD_UNITS = ("SELECT shard_no, slice, first_piece, end_piece, record_count, carried, results_count, dead_count, "
               "files, epoch, ran_in FROM shards WHERE version = :v ORDER BY shard_no")
_SHARD = "r.version = :v AND r.shard_no = :s"
# A shard's rows through the index by shard: the planner, without statistics, would walk the
# version's whole primary key in id order instead.
_BY_SHARD = "FROM results r INDEXED BY results_by_shard"
_OF_SHARD_FROM = (f"{_BY_SHARD} LEFT JOIN results o ON r.origin IS NOT NULL AND o.version = r.origin "
                  f"AND o.record_id = r.record_id " + _PLANNED_ACL.format(t="r"))
_COMPUTED_FROM = f"{_BY_SHARD} " + _PLANNED_ACL.format(t="r")
RESULTS_OF_SHARD = f"SELECT {_RESULT_COLUMNS} {_OF_SHARD_FROM} WHERE {_SHARD} ORDER BY r.record_id"
RESULTS_OF_SHARD_CARRY = (f"SELECT {_RESULT_COLUMNS}, c.carry {_OF_SHARD_FROM} {_CARRY_FROM} WHERE {_SHARD} "
                          f"ORDER BY r.record_id")
# What a worker computed: no carried result, so no row of another version to join.
_COMPUTED_COLUMNS = _RESULT_COLUMNS.replace("COALESCE(r.output, o.output)", "r.output").replace(
    "o.worker, o.epoch", "NULL, NULL")
COMPUTED_RESULTS_OF_SHARD = (f"SELECT {_COMPUTED_COLUMNS} {_COMPUTED_FROM} WHERE {_SHARD} AND r.origin IS NULL "
                             f"ORDER BY r.record_id")
COMPUTED_RESULTS_OF_SHARD_CARRY = (f"SELECT {_COMPUTED_COLUMNS}, c.carry {_COMPUTED_FROM} {_CARRY_FROM} WHERE {_SHARD} "
                                   f"AND r.origin IS NULL ORDER BY r.record_id")
# What a shard's worker computed, the columns its file holds alone (ShardOutcomes.shard_columns).
# (Each with its record's planned ACL as postgres_sql.SHARD_COLUMNS reads it: of the shard's current
# slice, by the record's id.)
SHARD_PIECES = "SELECT first_piece, end_piece FROM shards WHERE version = :v AND shard_no = :s"
SHARD_COLUMNS = (f"SELECT r.record_id, r.output, pacl.acl, r.label, r.model, r.attempt, r.input_tokens, "
                 f"r.output_tokens, r.created_at {_BY_SHARD} "
                 f"LEFT JOIN records pr ON pr.version = r.version AND pr.record_id = r.record_id "
                 f"AND (:first IS NULL OR (pr.piece >= :first AND pr.piece < :end)) "
                 f"LEFT JOIN acls pacl ON pacl.version = pr.version AND pacl.acl_no = pr.acl_no "
                 f"WHERE {_SHARD} AND r.origin IS NULL ORDER BY r.record_id")
DEAD_LETTERS_OF_SHARD = (f"SELECT {_DEAD_COLUMNS} FROM dead_letters d INDEXED BY dead_letters_by_shard "
                         f"{_PLANNED_ACL.format(t='d')} WHERE d.version = :v AND d.shard_no = :s ORDER BY d.record_id")
DEAD_LETTERS_OF_SHARD_CARRY = (f"SELECT {_DEAD_COLUMNS}, c.carry FROM dead_letters d INDEXED BY dead_letters_by_shard "
                               f"{_PLANNED_ACL.format(t='d')} LEFT JOIN records c "
                               f"ON c.version = :v AND c.record_id = d.record_id "
                               f"WHERE d.version = :v AND d.shard_no = :s ORDER BY d.record_id")

