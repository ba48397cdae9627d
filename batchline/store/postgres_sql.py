"""All SQL of the PostgreSQL store: versioned migrations and the statements.

Kept apart from the connection handling in `postgres.py` so that a new store
method is one statement here and one short method there, and a schema change
is one new entry at the end of `MIGRATIONS` (never an edit of an applied one).

Layout and why:

- `shards` is keyed (version, shard_no). A renewal touches only
  `lease_expires`, which no index covers, so with the table's fillfactor it is
  a HOT update of the worker's own row: hundreds of workers renewing never
  share a row or an index page. Claims walk a partial index of the open
  shards of one version (`FOR UPDATE SKIP LOCKED`), so claimers skip each
  other's rows instead of queueing on them.
- `records`, `results` and `dead_letters` are partitioned by job version (one
  partition per version, made when it is planned): a job's rows and their
  primary-key index live apart from every other job's, reading or exporting a
  version touches only its partition, and an old version can be dropped
  whole. Inside a version, record ids of one shard are contiguous in the key,
  and each shard has one writer, so concurrent writers insert into different
  leaf pages of the primary key.
- Every time is `batchline_now()`: the server's `now()` plus the test clock's
  offset, as SQLite does with its `clock` table.
- `events.op` carries the token of the operation that wrote the event. A write
  retried after a lost connection first looks for its token: found, the first
  try committed and its outcome is read back instead of being applied twice.
- Row-level security is on for every table that holds many jobs; the owner
  (who migrates, plans, publishes) is not subject to it, and `batchline grants`
  adds the policies of a worker role bound to one version.
"""

from __future__ import annotations

# (version, description, SQL). Applied in order under an advisory lock, each in
# the transaction that records it; an applied entry is never edited.
MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "shard table, results, dead letters, event log, pointers", """
CREATE TABLE clock (id int PRIMARY KEY CHECK (id = 1), offset_s float8 NOT NULL);
INSERT INTO clock (id, offset_s) VALUES (1, 0);

CREATE FUNCTION batchline_now() RETURNS float8 LANGUAGE sql STABLE AS
$$ SELECT extract(epoch FROM now())::float8 + offset_s FROM clock WHERE id = 1 $$;

CREATE TABLE jobs (
    version text PRIMARY KEY,
    name text NOT NULL,
    state text NOT NULL CHECK (state IN ('planning', 'ready', 'sealed', 'removed')),
    spec jsonb NOT NULL,
    lease_seconds float8 GENERATED ALWAYS AS ((spec -> 'shards' ->> 'lease_seconds')::float8) STORED,
    plan_token text,
    record_count bigint NOT NULL DEFAULT 0,
    shard_count int NOT NULL DEFAULT 0,
    carried_count bigint NOT NULL DEFAULT 0,
    created_at float8 NOT NULL,
    sealed_at float8
);
CREATE INDEX jobs_by_state ON jobs (state, created_at);

CREATE TABLE shards (
    version text NOT NULL,
    shard_no int NOT NULL,
    slice jsonb NOT NULL,
    record_count int NOT NULL,
    state text NOT NULL CHECK (state IN ('ready', 'leased', 'done', 'submitted')),
    owner text,
    epoch bigint NOT NULL DEFAULT 0,
    lease_expires float8,
    claims int NOT NULL DEFAULT 0,
    results_count int NOT NULL DEFAULT 0,
    dead_count int NOT NULL DEFAULT 0,
    done_at float8,
    PRIMARY KEY (version, shard_no)
) WITH (fillfactor = 70);
CREATE INDEX shards_open ON shards (version, shard_no) WHERE state IN ('ready', 'leased', 'submitted');
CREATE INDEX shards_done ON shards (version, done_at) WHERE state = 'done';

CREATE TABLE records (
    version text NOT NULL,
    record_id text COLLATE "C" NOT NULL,
    shard_no int NOT NULL,
    content_hash text NOT NULL,
    PRIMARY KEY (version, record_id)
) PARTITION BY LIST (version);

CREATE TABLE results (
    version text NOT NULL,
    record_id text COLLATE "C" NOT NULL,
    shard_no int NOT NULL,
    output text,  -- NULL for a carried result: the row of version `origin` holds it
    origin text,
    label text,
    acl text,
    worker text NOT NULL,
    epoch bigint NOT NULL,
    attempt int NOT NULL,
    input_tokens int,
    output_tokens int,
    created_at float8 NOT NULL,
    PRIMARY KEY (version, record_id)
) PARTITION BY LIST (version);
CREATE INDEX results_carried ON results (origin, record_id) WHERE origin IS NOT NULL;

CREATE TABLE dead_letters (
    version text NOT NULL,
    record_id text COLLATE "C" NOT NULL,
    shard_no int NOT NULL,
    kind text NOT NULL,
    error text NOT NULL,
    acl text,
    attempts int NOT NULL,
    worker text,
    epoch bigint,
    created_at float8 NOT NULL,
    PRIMARY KEY (version, record_id)
) PARTITION BY LIST (version);

CREATE TABLE attempts (
    version text NOT NULL,
    record_id text COLLATE "C" NOT NULL,
    attempts int NOT NULL,
    last_kind text NOT NULL,
    last_error text NOT NULL,
    PRIMARY KEY (version, record_id)
);

CREATE TABLE events (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    version text,
    ts float8 NOT NULL,
    kind text NOT NULL,
    worker text,
    shard_no int,
    epoch bigint,
    detail jsonb NOT NULL DEFAULT '{}',
    op uuid
);
CREATE INDEX events_by_version ON events (version, kind, id);
CREATE INDEX events_by_op ON events (op) WHERE op IS NOT NULL;

CREATE TABLE validations (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    version text NOT NULL,
    passed boolean NOT NULL,
    report jsonb NOT NULL,
    ts float8 NOT NULL
);
CREATE INDEX validations_by_version ON validations (version, id);

CREATE TABLE pointers (name text PRIMARY KEY, version text NOT NULL, updated_at float8 NOT NULL);
CREATE TABLE publications (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    version text NOT NULL,
    previous text,
    action text NOT NULL,
    who text NOT NULL,
    reason text,
    validation text,
    ts float8 NOT NULL
);
"""),
    (2, "row-level security on the tables that hold many jobs", """
ALTER TABLE jobs ENABLE ROW LEVEL SECURITY;
ALTER TABLE shards ENABLE ROW LEVEL SECURITY;
ALTER TABLE records ENABLE ROW LEVEL SECURITY;
ALTER TABLE results ENABLE ROW LEVEL SECURITY;
ALTER TABLE dead_letters ENABLE ROW LEVEL SECURITY;
ALTER TABLE attempts ENABLE ROW LEVEL SECURITY;
ALTER TABLE events ENABLE ROW LEVEL SECURITY;
ALTER TABLE validations ENABLE ROW LEVEL SECURITY;
"""),
    # jsonb keeps object keys in its own order; the order of a schema's properties
    # is the order a constrained engine writes them in, so the spec is kept as written.
    (3, "job specs keep their key order", """
ALTER TABLE jobs DROP COLUMN lease_seconds;
ALTER TABLE jobs ALTER COLUMN spec TYPE json USING spec::json;
ALTER TABLE jobs ADD COLUMN lease_seconds float8
    GENERATED ALWAYS AS ((spec -> 'shards' ->> 'lease_seconds')::float8) STORED;
"""),
    (4, "routes to hosted providers: a shard's route and batch, the model of each result", """
ALTER TABLE shards ADD COLUMN route text NOT NULL DEFAULT 'local';
ALTER TABLE shards ADD COLUMN batch jsonb;
ALTER TABLE shards ADD COLUMN poll_at float8;
ALTER TABLE results ADD COLUMN model text;
"""),
]

SCHEMA_VERSION = MIGRATIONS[-1][0]

# One constant for every batchline store, so migrations never run twice at once.
MIGRATION_LOCK = 0x6261746368  # "batch"

MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version int PRIMARY KEY,
    description text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""

HAS_MIGRATIONS = "SELECT to_regclass('schema_migrations') IS NOT NULL"
CURRENT_SCHEMA = "SELECT COALESCE(max(version), 0) FROM schema_migrations"

# Tables split by version; each version gets one partition of each when planned.
PARTITIONED = ("records", "results", "dead_letters")
# Only a version still in 'planning' is ever deleted whole: it never existed for
# anyone, so its rows and its events go.
PER_VERSION = ("shards", "attempts", "events", "jobs")

OPEN_STATES = "('ready', 'leased', 'submitted')"
FENCE = ("version = %(v)s AND shard_no = %(s)s AND owner = %(w)s AND epoch = %(e)s "
         "AND state = 'leased'")

# --- clock -------------------------------------------------------------------------

NOW = "SELECT batchline_now()"
SHIFT_CLOCK = "UPDATE clock SET offset_s = offset_s + %s WHERE id = 1"

# --- events ------------------------------------------------------------------------

INSERT_EVENT = ("INSERT INTO events (version, ts, kind, worker, shard_no, epoch, detail, op) "
                "VALUES (%s, batchline_now(), %s, %s, %s, %s, %s, %s)")
EVENTS_BY_OP = "SELECT kind, version, shard_no, epoch, detail FROM events WHERE op = %s ORDER BY id"
EVENTS = "SELECT id, version, ts, kind, worker, shard_no, epoch, detail FROM events"

# --- jobs and planning ----------------------------------------------------------------

JOB_COLUMNS = "version, name, state, spec, record_count, shard_count, created_at, sealed_at, carried_count"
JOB = f"SELECT {JOB_COLUMNS} FROM jobs WHERE version = %s"
JOBS = f"SELECT {JOB_COLUMNS} FROM jobs WHERE state IN ('ready', 'sealed') ORDER BY created_at"
PLAN_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
JOB_STATE_FOR_UPDATE = "SELECT state FROM jobs WHERE version = %s FOR UPDATE"
INSERT_JOB = ("INSERT INTO jobs (version, name, state, spec, plan_token, created_at) "
              "VALUES (%s, %s, 'planning', %s, %s, batchline_now())")
PLAN_TOKEN = "SELECT plan_token FROM jobs WHERE version = %s AND state = 'planning' FOR SHARE"
PLAN_TOKEN_ANY = "SELECT plan_token FROM jobs WHERE version = %s FOR UPDATE"
INSERT_SHARD = ("INSERT INTO shards (version, shard_no, slice, record_count, state, route) "
                "VALUES (%s, %s, %s, %s, 'ready', %s)")
COPY_RECORDS = "COPY records (version, record_id, shard_no, content_hash) FROM STDIN"
RECORD_SHARD = "SELECT shard_no FROM records WHERE version = %s AND record_id = ANY(%s) LIMIT 1"
PLAN_DEAD_LETTERS = """
INSERT INTO dead_letters (version, record_id, shard_no, kind, error, acl, attempts, created_at)
SELECT %(v)s, u.record_id, %(s)s, u.kind, u.error, u.acl, 0, batchline_now()
FROM unnest(%(ids)s::text[], %(kinds)s::text[], %(errors)s::text[], %(acls)s::text[])
     AS u(record_id, kind, error, acl)"""
BUMP_DEAD = "UPDATE shards SET dead_count = dead_count + %s WHERE version = %s AND shard_no = %s"
COMMIT_PLAN = ("UPDATE jobs SET state = 'ready', record_count = %s, shard_count = %s, plan_token = NULL "
               "WHERE version = %s")
SEAL_IF_NOTHING_OPEN = f"""
UPDATE jobs SET state = 'sealed', sealed_at = batchline_now()
WHERE version = %(v)s AND NOT EXISTS (SELECT 1 FROM shards WHERE version = %(v)s AND state IN {OPEN_STATES})"""

# An incremental plan refers to the base version's results for records whose id
# and content hash are unchanged; the payload stays in the row that computed it.
CARRY = """
INSERT INTO results (version, record_id, shard_no, output, origin, label, acl, worker, epoch, attempt,
                     input_tokens, output_tokens, created_at, model)
SELECT n.version, n.record_id, n.shard_no, NULL, COALESCE(b.origin, b.version), b.label, b.acl,
       'carried', 0, b.attempt, b.input_tokens, b.output_tokens, batchline_now(), b.model
FROM records n
JOIN records p ON p.version = %(base)s AND p.record_id = n.record_id AND p.content_hash = n.content_hash
JOIN results b ON b.version = %(base)s AND b.record_id = n.record_id
WHERE n.version = %(v)s"""
# One pass over the carried rows, not one per shard.
CARRY_COUNTS = """
UPDATE shards s SET results_count = s.results_count + c.n
FROM (SELECT shard_no, count(*) AS n FROM results WHERE version = %(v)s AND origin IS NOT NULL
      GROUP BY shard_no) c
WHERE s.version = %(v)s AND s.shard_no = c.shard_no"""
SET_CARRIED = "UPDATE jobs SET carried_count = %(n)s WHERE version = %(v)s"
CARRY_DONE = ("UPDATE shards SET state = 'done', done_at = batchline_now() WHERE version = %(v)s "
              "AND results_count + dead_count = record_count")

# --- leases --------------------------------------------------------------------------

READY_JOBS = "SELECT version, lease_seconds FROM jobs WHERE state = 'ready' ORDER BY created_at"
OPEN_VERSIONS = f"""
SELECT j.version FROM jobs j
WHERE j.state = 'ready'
  AND EXISTS (SELECT 1 FROM shards s WHERE s.version = j.version AND s.state IN {OPEN_STATES})
ORDER BY j.created_at"""

# The lowest shard that is ready or whose lease has expired, skipping rows other
# claimers hold locked right now: they are being granted, and waiting on them
# would make claimers queue on each other.
PICK_SHARD = """
SELECT s.shard_no, s.state, s.owner, s.epoch, s.slice, s.record_count, batchline_now(), j.lease_seconds,
       s.route, s.batch
FROM shards s JOIN jobs j ON j.version = s.version
WHERE s.version = %(v)s AND j.state = 'ready' AND s.state IN ('ready', 'leased', 'submitted')
  AND (s.state = 'ready' OR (s.state = 'leased' AND s.lease_expires <= batchline_now())
       OR (s.state = 'submitted' AND s.poll_at <= batchline_now()))
  AND (%(routes)s::text[] IS NULL OR s.route = ANY(%(routes)s::text[]))
ORDER BY s.shard_no
LIMIT 1
FOR UPDATE OF s SKIP LOCKED"""

# The grant and its events in one statement (the shard's row is locked since
# PICK_SHARD, so the new epoch is the old one plus one).
GRANT_SHARD = """
WITH granted AS (
    UPDATE shards SET state = 'leased', owner = %(w)s, epoch = epoch + 1,
                      lease_expires = %(now)s + %(lease)s, claims = claims + 1
    WHERE version = %(v)s AND shard_no = %(s)s
    RETURNING epoch, lease_expires
), logged AS (
    INSERT INTO events (version, ts, kind, worker, shard_no, epoch, detail, op)
    SELECT %(v)s, batchline_now(), e.kind, e.worker, %(s)s, e.epoch, e.detail, %(op)s
    FROM granted,
         (VALUES (1, 'lease_expired', %(old_owner)s::text, %(old_epoch)s::bigint, %(expired)s::jsonb),
                 (2, 'claim', %(w)s::text, %(old_epoch)s::bigint + 1, '{}'::jsonb))
         AS e(ord, kind, worker, epoch, detail)
    WHERE e.ord = 2 OR %(expired)s::jsonb IS NOT NULL
    ORDER BY e.ord
)
SELECT epoch, lease_expires FROM granted"""

LEASE_BY_CLAIM = ("SELECT slice, record_count, lease_expires, owner, epoch, route, batch FROM shards "
                  "WHERE version = %s AND shard_no = %s")

RENEW = """
UPDATE shards s SET lease_expires = batchline_now() + j.lease_seconds
FROM jobs j
WHERE j.version = s.version AND s.version = %(v)s AND s.shard_no = %(s)s AND s.owner = %(w)s
  AND s.epoch = %(e)s AND s.state = 'leased'
RETURNING s.lease_expires"""

# A batch already at the provider is not given up with the lease: the shard
# waits there for the next poller, who must not submit it again.
RELEASE = f"""
UPDATE shards SET state = CASE WHEN batch ->> 'batch_id' IS NOT NULL THEN 'submitted' ELSE 'ready' END,
                  owner = NULL, lease_expires = NULL, poll_at = batchline_now()
WHERE {FENCE}"""
SET_BATCH = f"UPDATE shards SET batch = %(batch)s WHERE {FENCE}"
SHARD_FOR_AWAIT = ("SELECT state, owner, epoch, batch FROM shards WHERE version = %s AND shard_no = %s "
                   "FOR NO KEY UPDATE")
AWAIT_PROVIDER = f"""
UPDATE shards SET state = 'submitted', batch = %(batch)s, lease_expires = NULL,
                  poll_at = batchline_now() + %(poll_in)s
WHERE {FENCE}"""

SHARD_FOR_COMPLETE = ("SELECT state, owner, epoch, record_count, results_count, dead_count FROM shards "
                      "WHERE version = %s AND shard_no = %s FOR NO KEY UPDATE")
# Completions of one version take the job's row lock only at the end, so the
# one that finishes the last open shard sees (in SEAL's fresh snapshot, after
# the lock) every other completion committed, and seals exactly once.
FINISH_SHARD = f"""
WITH finished AS (
    UPDATE shards SET state = 'done', done_at = batchline_now(), lease_expires = NULL WHERE {FENCE}
    RETURNING 1
), logged AS (
    INSERT INTO events (version, ts, kind, worker, shard_no, epoch, detail, op)
    SELECT %(v)s, batchline_now(), 'complete', %(w)s, %(s)s, %(e)s, %(detail)s, %(op)s FROM finished
)
SELECT 1 FROM jobs WHERE version = %(v)s FOR NO KEY UPDATE"""
SEAL = f"""
WITH sealed AS (
    UPDATE jobs SET state = 'sealed', sealed_at = batchline_now()
    WHERE version = %(v)s AND state = 'ready'
      AND NOT EXISTS (SELECT 1 FROM shards WHERE version = %(v)s AND state IN {OPEN_STATES})
    RETURNING version
)
INSERT INTO events (version, ts, kind, worker, detail, op)
SELECT version, batchline_now(), 'seal', %(w)s, '{{}}', %(op)s FROM sealed"""

HAS_OPEN = f"""
SELECT EXISTS (SELECT 1 FROM shards s JOIN jobs j ON j.version = s.version
               WHERE j.state = 'ready' AND s.state IN {OPEN_STATES}
                 AND (%(routes)s::text[] IS NULL OR s.route = ANY(%(routes)s::text[])))"""
HAS_OPEN_VERSION = f"""
SELECT EXISTS (SELECT 1 FROM shards s JOIN jobs j ON j.version = s.version
               WHERE j.state = 'ready' AND s.version = %(v)s AND s.state IN {OPEN_STATES}
                 AND (%(routes)s::text[] IS NULL OR s.route = ANY(%(routes)s::text[])))"""

# --- records --------------------------------------------------------------------------

ANSWERED = """
SELECT record_id FROM results WHERE version = %(v)s AND record_id = ANY(%(ids)s)
UNION ALL
SELECT record_id FROM dead_letters WHERE version = %(v)s AND record_id = ANY(%(ids)s)"""
ATTEMPTS = "SELECT record_id, attempts FROM attempts WHERE version = %s AND record_id = ANY(%s)"

FENCE_LOCK = f"SELECT 1 FROM shards WHERE {FENCE} FOR NO KEY UPDATE"

# A put commits without waiting for its WAL flush (synchronous_commit off for
# this transaction only): the commit that costs most per row, and the one whose
# loss is harmless. WAL is flushed in order, so the shard's completion, which
# does wait, cannot be durable unless every put before it is; a server crash
# loses at most the last fraction of a second of puts, the shard then cannot
# complete (its count is short), and after its lease those records are done again.
#
# One round trip per flush: the fence takes the shard row's lock (so no claim
# can take the shard over until this commits), the rows come from `source`, and
# the shard's result count moves in the same statement.
def _put_results(source: str) -> str:
    return f"""
WITH fence AS (
    SELECT batchline_now() AS now, set_config('synchronous_commit', 'off', true)
    FROM shards WHERE {FENCE} FOR NO KEY UPDATE
), ins AS (
    INSERT INTO results (version, record_id, shard_no, output, label, acl, worker, epoch, attempt,
                         input_tokens, output_tokens, created_at, model)
    SELECT %(v)s, u.record_id, %(s)s, u.output, u.label, u.acl, %(w)s, %(e)s, u.attempt,
           u.input_tokens, u.output_tokens, fence.now, u.model
    FROM fence, {source}
    WHERE NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.version = %(v)s AND d.record_id = u.record_id)
    ON CONFLICT (version, record_id) DO NOTHING
    RETURNING 1
), bump AS (
    UPDATE shards SET results_count = results_count + (SELECT count(*) FROM ins)
    WHERE version = %(v)s AND shard_no = %(s)s AND EXISTS (SELECT 1 FROM fence)
)
SELECT (SELECT count(*) FROM fence), (SELECT count(*) FROM ins)"""


# The rows as arrays in parameters, for the smallest flushes.
PUT_RESULTS = _put_results("""
         unnest(%(ids)s::text[], %(outputs)s::text[], %(labels)s::text[], %(acls)s::text[],
                %(attempts)s::int[], %(tin)s::int[], %(tout)s::int[], %(models)s::text[])
         AS u(record_id, output, label, acl, attempt, input_tokens, output_tokens, model)""")

# The COPY path of the same put, for all but the smallest flushes (it parses
# rows faster than arrays in parameters): rows go to a per-session staging
# table, then the same insert-select under the same fence.
CREATE_STAGE = """
CREATE TEMP TABLE IF NOT EXISTS put_stage (
    record_id text, output text, label text, acl text, attempt int, input_tokens int, output_tokens int,
    model text
) ON COMMIT DELETE ROWS"""
COPY_STAGE = ("COPY put_stage (record_id, output, label, acl, attempt, input_tokens, output_tokens, model) "
              "FROM STDIN (FORMAT BINARY)")
STAGE_TYPES = ["text", "text", "text", "text", "int4", "int4", "int4", "text"]
PUT_FROM_STAGE = _put_results("put_stage u")

DEAD_LETTER = f"""
WITH fence AS (
    SELECT batchline_now() AS now FROM shards WHERE {FENCE} FOR NO KEY UPDATE
), ins AS (
    INSERT INTO dead_letters (version, record_id, shard_no, kind, error, acl, attempts, worker, epoch,
                              created_at)
    SELECT %(v)s, u.record_id, %(s)s, u.kind, u.error, u.acl, u.attempts, %(w)s, %(e)s, fence.now
    FROM fence,
         unnest(%(ids)s::text[], %(kinds)s::text[], %(errors)s::text[], %(acls)s::text[],
                %(attempts)s::int[])
         AS u(record_id, kind, error, acl, attempts)
    WHERE NOT EXISTS (SELECT 1 FROM results r WHERE r.version = %(v)s AND r.record_id = u.record_id)
    ON CONFLICT (version, record_id) DO NOTHING
    RETURNING 1
), bump AS (
    UPDATE shards SET dead_count = dead_count + (SELECT count(*) FROM ins)
    WHERE version = %(v)s AND shard_no = %(s)s AND EXISTS (SELECT 1 FROM fence)
)
SELECT (SELECT count(*) FROM fence), (SELECT count(*) FROM ins)"""

IS_ANSWERED = """
SELECT EXISTS (SELECT 1 FROM results WHERE version = %(v)s AND record_id = %(r)s)
    OR EXISTS (SELECT 1 FROM dead_letters WHERE version = %(v)s AND record_id = %(r)s)"""
CHARGE = """
INSERT INTO attempts (version, record_id, attempts, last_kind, last_error) VALUES (%s, %s, 1, %s, %s)
ON CONFLICT (version, record_id) DO UPDATE
SET attempts = attempts.attempts + 1, last_kind = excluded.last_kind, last_error = excluded.last_error
RETURNING attempts"""

# --- reading ---------------------------------------------------------------------------

STATUS_SHARDS = ("SELECT state, count(*), COALESCE(sum(results_count), 0), COALESCE(sum(dead_count), 0) "
                 "FROM shards WHERE version = %s GROUP BY state")
DEAD_BY_KIND = "SELECT kind, count(*) FROM dead_letters WHERE version = %s GROUP BY kind"
LEASES_LOST = "SELECT count(*) FROM events WHERE version = %s AND kind = 'lease_expired'"
RECENT = ("SELECT COALESCE(sum(record_count), 0) FROM shards WHERE version = %s AND state = 'done' "
          "AND done_at >= %s")
SHARD_ROWS = ("SELECT shard_no, state, owner, epoch, lease_expires, claims, record_count, results_count, "
              "dead_count, route, batch ->> 'batch_id', poll_at FROM shards WHERE version = %s ORDER BY shard_no")
RESULT_HISTOGRAM = """
SELECT attempt, LEAST(GREATEST(floor((created_at - %(start)s) / %(width)s)::int, 0), %(last)s) AS bin, count(*)
FROM results WHERE version = %(v)s AND origin IS NULL GROUP BY attempt, bin"""
ROUTE_SHARDS = ("SELECT route, count(*), COALESCE(sum(record_count), 0), COALESCE(sum(dead_count), 0) "
                "FROM shards WHERE version = %s GROUP BY route")
ROUTE_RESULTS = """
SELECT s.route, count(*), COALESCE(sum(r.input_tokens), 0), COALESCE(sum(r.output_tokens), 0)
FROM results r JOIN shards s ON s.version = r.version AND s.shard_no = r.shard_no
WHERE r.version = %s AND r.origin IS NULL GROUP BY s.route"""
# A carried result's payload lives in the row of the version that computed it.
RESULT_COLUMNS = ("r.record_id, COALESCE(r.output, o.output), r.acl, r.shard_no, r.worker, r.epoch, r.attempt, "
                  "r.created_at, r.input_tokens, r.output_tokens, r.label, r.origin, r.model")
RESULTS_FROM = ("FROM results r LEFT JOIN results o "
                "ON r.origin IS NOT NULL AND o.version = r.origin AND o.record_id = r.record_id")
RESULTS_PAGE = (f"SELECT {RESULT_COLUMNS} {RESULTS_FROM} WHERE r.version = %s AND r.record_id > %s "
                f"ORDER BY r.record_id LIMIT %s")
COMPUTED_RESULTS_PAGE = (f"SELECT {RESULT_COLUMNS} {RESULTS_FROM} WHERE r.version = %s AND r.record_id > %s "
                         f"AND r.origin IS NULL ORDER BY r.record_id LIMIT %s")
RESULTS_FOR = f"SELECT {RESULT_COLUMNS} {RESULTS_FROM} WHERE r.version = %s AND r.record_id = ANY(%s)"
TOKEN_TOTALS = ("SELECT COALESCE(sum(input_tokens), 0), COALESCE(sum(output_tokens), 0) FROM results "
                "WHERE version = %s AND origin IS NULL")
RUN_THROUGHPUT = """
SELECT sum((c.detail ->> 'records')::float8), sum(c.ts - k.ts)
FROM events c
JOIN events k ON k.version = c.version AND k.kind = 'claim' AND k.shard_no = c.shard_no AND k.epoch = c.epoch
WHERE c.version = %s AND c.kind = 'complete'"""
DEAD_LETTERS_PAGE = ("SELECT record_id, shard_no, kind, error, acl, attempts, worker, created_at FROM dead_letters "
                     "WHERE version = %s AND record_id > %s ORDER BY record_id LIMIT %s")
PLANNED_PAGE = "SELECT record_id FROM records WHERE version = %s AND record_id > %s ORDER BY record_id LIMIT %s"
RESOLVE_NAME = "SELECT version FROM pointers WHERE name = %s"

# --- validation and publication -------------------------------------------------------------

ANALYZE_PARTITION = "ANALYZE {}"
COVERAGE_SETTINGS = "SET LOCAL enable_nestloop = off; SET LOCAL work_mem = '256MB'"
COUNT_RECORDS = "SELECT count(*) FROM records WHERE version = %s"
COUNT_RESULTS = "SELECT count(*) FROM results WHERE version = %s"
COUNT_DEAD = "SELECT count(*) FROM dead_letters WHERE version = %s"
# One join per outcome table counts the outcomes whose id the snapshot has (ids
# are unique on both sides); missing and unexpected follow from it, and the
# anti-joins run only to list a sample when there are any.
COUNT_MATCHED = """
SELECT (SELECT count(*) FROM results r JOIN records p ON p.version = r.version AND p.record_id = r.record_id
        WHERE r.version = %(v)s)
     + (SELECT count(*) FROM dead_letters d JOIN records p ON p.version = d.version AND p.record_id = d.record_id
        WHERE d.version = %(v)s)"""
COUNT_BOTH = """
SELECT count(*) FROM dead_letters d WHERE d.version = %(v)s
AND EXISTS (SELECT 1 FROM results r WHERE r.version = %(v)s AND r.record_id = d.record_id)"""
MISSING_SAMPLE = """
SELECT p.record_id FROM records p WHERE p.version = %(v)s
AND NOT EXISTS (SELECT 1 FROM results r WHERE r.version = %(v)s AND r.record_id = p.record_id)
AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.version = %(v)s AND d.record_id = p.record_id)
ORDER BY p.record_id LIMIT %(n)s"""
UNEXPECTED_SAMPLE = """
SELECT x.record_id FROM (SELECT record_id FROM results WHERE version = %(v)s
                         UNION ALL SELECT record_id FROM dead_letters WHERE version = %(v)s) x
WHERE NOT EXISTS (SELECT 1 FROM records p WHERE p.version = %(v)s AND p.record_id = x.record_id)
ORDER BY x.record_id LIMIT %(n)s"""
LABEL_COUNTS = "SELECT label, count(*) FROM results WHERE version = %s GROUP BY label"
INSERT_VALIDATION = "INSERT INTO validations (version, passed, report, ts) VALUES (%s, %s, %s, batchline_now())"
LATEST_VALIDATION = "SELECT passed, report, ts FROM validations WHERE version = %s ORDER BY id DESC LIMIT 1"
POINTER_FOR_UPDATE = "SELECT version FROM pointers WHERE name = %s FOR UPDATE"
SET_POINTER = """
INSERT INTO pointers (name, version, updated_at) VALUES (%s, %s, batchline_now())
ON CONFLICT (name) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at"""
# The view named after the job reads through its pointer, so a reader's one
# statement sees the whole old version or the whole new one, never a mix.
VIEW_EXISTS = "SELECT to_regclass(%s) IS NOT NULL"
CREATE_VIEW = """
CREATE VIEW {view} AS
SELECT r.record_id AS id, COALESCE(r.output, o.output) AS output, r.acl AS acl, r.label AS label,
       r.version AS version
FROM pointers p
JOIN results r ON r.version = p.version
LEFT JOIN results o ON r.origin IS NOT NULL AND o.version = r.origin AND o.record_id = r.record_id
WHERE p.name = {name}"""
INSERT_PUBLICATION = """
INSERT INTO publications (name, version, previous, action, who, reason, validation, ts)
VALUES (%s, %s, %s, %s, %s, %s, %s, batchline_now())"""
PREVIOUS_PUBLISHED = """
SELECT previous FROM publications WHERE name = %s AND version = %s AND action = 'publish'
ORDER BY id DESC LIMIT 1"""
IS_SEALED = "SELECT EXISTS (SELECT 1 FROM jobs WHERE version = %s AND state = 'sealed')"
PUBLICATIONS = ("SELECT id, name, version, previous, action, who, reason, validation, ts FROM publications "
                "WHERE name = %s ORDER BY id")
IS_PUBLISHED = "SELECT EXISTS (SELECT 1 FROM pointers WHERE version = %s)"
# Rows that a later version carries stay: they hold that version's payload.
REMOVE_RESULTS = """
DELETE FROM results r WHERE r.version = %(v)s
AND NOT EXISTS (SELECT 1 FROM results c WHERE c.origin = %(v)s AND c.record_id = r.record_id)"""
REMOVE_PER_VERSION = ("shards", "records", "attempts", "dead_letters", "validations")
MARK_REMOVED = "UPDATE jobs SET state = 'removed' WHERE version = %s"
