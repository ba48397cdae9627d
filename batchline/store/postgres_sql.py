"""All SQL of the PostgreSQL store: versioned migrations and the statements.

Kept apart from the connection handling in `postgres.py` so that a new store
method is one statement here and one short method there, and a schema change
is one new entry at the end of `MIGRATIONS` (never an edit of an applied one).

Layout and why:

- `shards` is keyed (version, shard_no). A claim is three seeks under `FOR UPDATE
  SKIP LOCKED` (`_pick`): the lowest ready shard, the expired leases by their
  expiry (`shards_expiring`), the batches due by their time; claimers skip each
  other's rows instead of queueing on them, and a claim's cost does not grow with
  the leases held (walking the open shards in order passed every live lease: a
  thousand rows a claim with a thousand workers, claim p99 821 ms in
  `bench/fleet_load.py`). The price is the renewal's: it moves `lease_expires`,
  which that index covers, so it is no longer a HOT update, and writes an index
  entry per index of the row; a renewal still touches only its worker's own row.
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

import hashlib
from dataclasses import dataclass

from batchline.store import rights
from batchline.store.beats import HEARTBEAT_BOUND, HEARTBEAT_MAX_SECONDS, HEARTBEAT_MIN_SECONDS
from batchline.store.model import within_sql

# (version, description, SQL). Applied in order under an advisory lock, each in
# the transaction that records it; an applied entry is never edited.
_SHARD_FENCE_21 = """
CREATE FUNCTION batchline_shard_fence() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    why text;
    now_s float8 := batchline_now();
BEGIN
    IF pg_has_role(current_user, (SELECT relowner FROM pg_class WHERE oid = TG_RELID), 'MEMBER') THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'INSERT' THEN
        -- A split's new shard: ready, nobody's, of no epoch, nothing done of it.
        IF NEW.state <> 'ready' OR NEW.owner IS NOT NULL OR NEW.epoch <> 0 OR NEW.files IS NOT NULL
           OR NEW.results_count <> 0 OR NEW.carried <> 0 OR NEW.batch IS NOT NULL OR NEW.claims <> 0 THEN
            why := 'a new shard is a split''s: ready, nobody''s, nothing done of it';
        END IF;
    ELSIF NEW.version <> OLD.version OR NEW.shard_no <> OLD.shard_no OR NEW.slice IS DISTINCT FROM OLD.slice
          OR NEW.route IS DISTINCT FROM OLD.route OR NEW.first_piece IS DISTINCT FROM OLD.first_piece
          OR NEW.carried <> OLD.carried THEN
        why := 'a shard''s version, number, slice, route and carried results are the planner''s';
    ELSIF OLD.state = 'done' THEN
        why := 'a completed shard is not changed by a worker';
    -- Each test below is a violation unless it is known to hold: an unknown (NULL) is refused.
    ELSIF NEW.files IS DISTINCT FROM OLD.files
          AND NOT COALESCE(OLD.state = 'leased' AND NEW.state = 'done' AND NEW.epoch = OLD.epoch
                           AND NEW.owner IS NOT DISTINCT FROM OLD.owner, false) THEN
        why := 'a shard''s file is recorded only by the completion of its current lease';
    ELSIF NEW.state = 'done' AND NOT COALESCE(OLD.state = 'leased' AND NEW.epoch = OLD.epoch
                                              AND NEW.results_count + NEW.dead_count = NEW.record_count, false) THEN
        why := 'a shard is completed only by its current lease, once every record has an outcome';
    ELSIF NEW.epoch < OLD.epoch OR NEW.epoch > OLD.epoch + 1 THEN
        why := 'an epoch only moves up by one, with a claim or a take-back';
    ELSIF NEW.epoch = OLD.epoch + 1 AND NOT COALESCE(
            (NEW.state = 'leased' AND (OLD.state = 'ready'
                                       OR (OLD.state = 'leased' AND OLD.lease_expires <= now_s)
                                       OR (OLD.state = 'submitted' AND OLD.poll_at <= now_s)))
            OR (OLD.state = 'leased' AND NEW.state IN ('ready', 'submitted') AND NEW.owner IS NULL), false) THEN
        why := 'a new epoch is a claim of a claimable shard or the take-back of a lease';
    ELSIF NEW.epoch = OLD.epoch AND NEW.owner IS DISTINCT FROM OLD.owner AND NEW.owner IS NOT NULL THEN
        why := 'a lease changes hands only with a new epoch';
    ELSIF NEW.results_count < OLD.results_count OR NEW.input_tokens < OLD.input_tokens
          OR NEW.output_tokens < OLD.output_tokens OR NEW.claims < OLD.claims THEN
        why := 'a shard''s counts of outcomes, tokens and claims never go down';
    ELSIF (NEW.record_count <> OLD.record_count OR NEW.dead_count < OLD.dead_count
           OR NEW.end_piece IS DISTINCT FROM OLD.end_piece)
          AND NOT COALESCE(OLD.state = 'leased' AND NEW.end_piece < OLD.end_piece
                           AND NEW.record_count < OLD.record_count AND NEW.record_count >= 0, false) THEN
        why := 'a shard''s records shrink only when a split moves its tail';
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'shard % of %: %', COALESCE(NEW.shard_no, OLD.shard_no), COALESCE(NEW.version, OLD.version),
            why USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER shards_fence BEFORE INSERT OR UPDATE ON shards
    FOR EACH ROW EXECUTE FUNCTION batchline_shard_fence();
"""
# Migration 25 states the fence again with two rules more: a shard's home region is the
# planner's, and where it ran changes only with a claim (a new epoch).
_SHARD_FENCE_25 = (_SHARD_FENCE_21.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")
                   .split("CREATE TRIGGER")[0]
                   .replace("OR NEW.carried <> OLD.carried THEN",
                            "OR NEW.carried <> OLD.carried OR NEW.home IS DISTINCT FROM OLD.home THEN")
                   .replace("    ELSIF NEW.epoch = OLD.epoch AND NEW.owner IS DISTINCT FROM OLD.owner",
                            "    ELSIF NEW.epoch = OLD.epoch AND NEW.ran_in IS DISTINCT FROM OLD.ran_in THEN\n"
                            "        why := 'where a shard runs is set only by a claim';\n"
                            "    ELSIF NEW.epoch = OLD.epoch AND NEW.owner IS DISTINCT FROM OLD.owner"))

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
    # Route totals and tokens read from the shards alone, so status costs the same at
    # any size; the claimer's process, so that a take-back can prove its death; and
    # published views in a schema of their own, apart from the store's tables.
    (5, "per-shard token and carried counters, the owner's process, a schema for published views", """
ALTER TABLE shards ADD COLUMN carried int NOT NULL DEFAULT 0;
ALTER TABLE shards ADD COLUMN input_tokens bigint NOT NULL DEFAULT 0;
ALTER TABLE shards ADD COLUMN output_tokens bigint NOT NULL DEFAULT 0;
ALTER TABLE shards ADD COLUMN owner_process jsonb;
UPDATE shards s SET carried = c.carried, input_tokens = c.tin, output_tokens = c.tout
FROM (SELECT version, shard_no, count(*) FILTER (WHERE origin IS NOT NULL) AS carried,
             COALESCE(sum(input_tokens) FILTER (WHERE origin IS NULL), 0) AS tin,
             COALESCE(sum(output_tokens) FILTER (WHERE origin IS NULL), 0) AS tout
      FROM results GROUP BY version, shard_no) c
WHERE s.version = c.version AND s.shard_no = c.shard_no;
CREATE SCHEMA IF NOT EXISTS published;
DO $$
DECLARE n text;
BEGIN
    FOR n IN SELECT p.name FROM pointers p
             JOIN pg_views v ON v.viewname = p.name AND v.schemaname = current_schema() LOOP
        EXECUTE format('ALTER VIEW %I SET SCHEMA published', n);
    END LOOP;
END $$;
"""),
    # What each publication target (a warehouse table) showed readers after a publish,
    # so the next publish changes it only from that state; a shard's pieces, so its
    # unstarted tail can be split off to another worker.
    (6, "publication targets' state, shard pieces", """
ALTER TABLE publications ADD COLUMN targets jsonb;
ALTER TABLE shards ADD COLUMN first_piece int;
ALTER TABLE shards ADD COLUMN end_piece int;
ALTER TABLE shards ADD COLUMN started_piece int;
"""),
    # A cancelled version keeps its rows (its dead letters and events say why it was
    # abandoned) until it is deleted, so it is a state of its own: 'removed' means the
    # rows are gone.
    (7, "a job state for cancelled versions", """
ALTER TABLE jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_check
    CHECK (state IN ('planning', 'ready', 'sealed', 'cancelled', 'removed'));
"""),
    # A scheduled run's key (its scheduled minute) names the one version it plans, so a
    # worker slot restarted later, or a second slot that saw a newer snapshot, runs that
    # version instead of planning another.
    (8, "plan keys of scheduled runs", """
CREATE TABLE plan_keys (
    name text NOT NULL,
    key text NOT NULL,
    version text NOT NULL,
    created_at float8 NOT NULL,
    PRIMARY KEY (name, key)
);
"""),
    # The engine runtime (its packages and versions) the first worker of a version loaded:
    # a worker whose engine differs refuses the version, so it never mixes engine builds.
    (9, "engine runtimes pinned per version", """
CREATE TABLE engine_runtimes (
    version text PRIMARY KEY,
    runtime text NOT NULL,
    worker text NOT NULL,
    pinned_at float8 NOT NULL
);
ALTER TABLE engine_runtimes ENABLE ROW LEVEL SECURITY;
"""),
    # A version whose dead letters pass its bound is halted for every worker until it is
    # resumed or cancelled. The bound is the store's (the spec's at planning, or the one
    # `resume` was given), and the planner's own dead letters are counted once, so the
    # outcomes a version computed are read from the shards' counters alone.
    (10, "a job state for halted versions, with their dead-letter bound", """
ALTER TABLE jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_check
    CHECK (state IN ('planning', 'ready', 'halted', 'sealed', 'cancelled', 'removed'));
ALTER TABLE jobs ADD COLUMN planned_dead bigint NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN abort_rate float8;
ALTER TABLE jobs ADD COLUMN abort_min bigint;
ALTER TABLE jobs ADD COLUMN halt jsonb;
UPDATE jobs j SET planned_dead = d.n
FROM (SELECT version, count(*) AS n FROM dead_letters WHERE worker IS NULL GROUP BY version) d
WHERE j.version = d.version;
"""),
    # A job over a published job reads its input from the store: planning copies each
    # upstream record's chosen text and ACL into the downstream's own records, at their
    # position in its input order, so a worker reads its shard from its own version's
    # partition alone (its role's policy admits no other).
    (11, "records hold the text, ACL and position of an input read from the store", """
ALTER TABLE records ADD COLUMN text text;
ALTER TABLE records ADD COLUMN acl text;
ALTER TABLE records ADD COLUMN position bigint;
CREATE INDEX records_by_position ON records (version, position) WHERE position IS NOT NULL;
"""),
    # Status counts the outcomes workers wrote within its window, so its rate moves
    # while a shard is under way rather than only as whole shards complete.
    (12, "outcomes by the time they were written", """
CREATE INDEX results_written ON results (version, created_at) WHERE origin IS NULL;
CREATE INDEX dead_letters_written ON dead_letters (version, created_at) WHERE worker IS NOT NULL;
"""),
    # output.carry's input fields, read at planning into each planned record (JSON text): a
    # result or dead letter is read with its record's, so a result carried from a base version
    # gets this version's values, and a worker never writes or reads them (its role cannot
    # read the planned records).
    (13, "carried input fields of planned records", """
ALTER TABLE records ADD COLUMN carry text;
"""),
    # What the prompt reads of a record (its text and class, not its ACL), hashed apart from
    # its content hash: an incremental plan carries the result of a record whose ACL alone
    # changed, under its new ACL, without inference.
    (14, "the hash of a planned record's text apart from its ACL", """
ALTER TABLE records ADD COLUMN text_hash text;
"""),
    # Paid workers a pacer bought to hold a version's deadline, one row per start of a slot
    # (paid-0, paid-1, ...): the slot's generation is what makes a second start of a slot that
    # runs "already there", and the rows are the store's own record of the paid worker time.
    # A worker's role sees and updates its version's rows only.
    (15, "paid workers: slots, their starts and their worker time", """
CREATE TABLE paid_workers (
    version text NOT NULL,
    slot text NOT NULL,
    generation int NOT NULL,
    launched_at float8 NOT NULL,
    launched_by text NOT NULL,
    cost_per_hour float8 NOT NULL,
    worker text,
    process jsonb,
    started_at float8,
    seen_at float8,
    claimed_at float8,
    stopped_at float8,
    stop_reason text,
    PRIMARY KEY (version, slot, generation)
);
ALTER TABLE paid_workers ENABLE ROW LEVEL SECURITY;
"""),
    # What OpenLineage is told of each version: its state changes, written in the transaction
    # that makes each (batchline.store.lineage), and the attempt of its computation (one more
    # per resume of a halted version). A version that was claimed before is taken as started.
    # A worker's role writes and drains its version's rows only.
    (16, "the lineage outbox, and the run attempt of each version", """
ALTER TABLE jobs ADD COLUMN run_attempt int NOT NULL DEFAULT 1;
ALTER TABLE jobs ADD COLUMN run_started_at float8;
UPDATE jobs j SET run_started_at = c.first
FROM (SELECT version, min(ts) AS first FROM events WHERE kind = 'claim' GROUP BY version) c
WHERE j.version = c.version;
CREATE TABLE lineage_outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    version text NOT NULL,
    kind text NOT NULL,
    attempt int NOT NULL,
    at float8 NOT NULL,
    detail jsonb,
    dedupe text UNIQUE,
    tries int NOT NULL DEFAULT 0,
    next_try_at float8 NOT NULL,
    claimed_by text,
    claimed_until float8,
    sent_at float8,
    given_up_at float8,
    last_error text
);
CREATE INDEX lineage_outbox_due ON lineage_outbox (next_try_at) WHERE sent_at IS NULL AND given_up_at IS NULL;
ALTER TABLE lineage_outbox ENABLE ROW LEVEL SECURITY;
"""),
    # A version's outcomes read a shard at a time (a target writes a file per shard, a worker its
    # shard's file), and the file a worker wrote of its shard, recorded as it completes it.
    (17, "outcomes by shard, and the files of a shard", """
CREATE INDEX results_by_shard ON results (version, shard_no);
CREATE INDEX dead_letters_by_shard ON dead_letters (version, shard_no);
ALTER TABLE shards ADD COLUMN files jsonb;
"""),
    # When a version's run started: set once, by the first runner, launcher or pacer that opens
    # it for work, and kept across resumes (run_started_at is lineage's, one per attempt). A
    # deadline's window and the pacing line count from it. A version claimed before counts
    # from its first claim. Workers read it and never write it.
    (18, "the run start of each version", """
ALTER TABLE jobs ADD COLUMN opened_at float8;
UPDATE jobs j SET opened_at = c.first
FROM (SELECT version, min(ts) AS first FROM events WHERE kind = 'claim' GROUP BY version) c
WHERE j.version = c.version;
"""),
    # A paid start's times are the database's: whatever an UPDATE sets them to, its first
    # heartbeat's time is kept as started_at, each heartbeat's as seen_at, its first claim's as
    # claimed_at, and its stop's as stopped_at (set once); its launch and price never change. The
    # spend max_cost is held against is computed from them, so a worker's role, which may update
    # its own start's heartbeat and stop, cannot make the spend look smaller.
    (19, "paid workers' times kept by the database", """
CREATE FUNCTION batchline_paid_times() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.launched_at := OLD.launched_at;
    NEW.cost_per_hour := OLD.cost_per_hour;
    NEW.seen_at := CASE WHEN NEW.seen_at IS DISTINCT FROM OLD.seen_at THEN batchline_now() ELSE OLD.seen_at END;
    NEW.started_at := COALESCE(OLD.started_at, CASE WHEN NEW.seen_at IS NOT NULL THEN NEW.seen_at END);
    NEW.claimed_at := COALESCE(OLD.claimed_at, CASE WHEN NEW.claimed_at IS NOT NULL THEN batchline_now() END);
    NEW.stopped_at := COALESCE(OLD.stopped_at, CASE WHEN NEW.stopped_at IS NOT NULL THEN batchline_now() END);
    RETURN NEW;
END $$;
CREATE TRIGGER paid_workers_times BEFORE UPDATE ON paid_workers
    FOR EACH ROW EXECUTE FUNCTION batchline_paid_times();
"""),
    # Every worker's heartbeat (batchline.store.beats), from its start (loading included) to its
    # exit: the capacity a pacer counts is the workers seen recently, not the owners of leases.
    # A worker's role writes its version's rows only.
    (20, "worker heartbeats", """
CREATE TABLE worker_beats (
    version text NOT NULL,
    worker text NOT NULL,
    paid_slot text,
    process jsonb,
    every_s float8 NOT NULL,
    started_at float8 NOT NULL,
    seen_at float8 NOT NULL,
    stopped_at float8,
    PRIMARY KEY (version, worker)
);
CREATE INDEX worker_beats_live ON worker_beats (version, seen_at) WHERE stopped_at IS NULL;
ALTER TABLE worker_beats ENABLE ROW LEVEL SECURITY;
"""),
    # A worker changes a shard only as one of the fenced statements it is given (claim, renew,
    # release, park at a provider, split, take back, complete), and records a shard's file only
    # in the completion of a shard leased at its current epoch whose every record has an
    # outcome. A trigger, not row-level security: a policy sees only the new row, and these
    # rules compare it with the old one. Any role that is not (a member of) the table's owner
    # is held to them; the owner (planning, carrying, resuming) is not.
    (21, "a worker's changes to shards are its fenced statements' only", _SHARD_FENCE_21),
    # A scheduled run's worker slots find the night's version by its key, under a role made for
    # the job's name: it sees that job's keys alone.
    (22, "plan keys under row-level security", """
ALTER TABLE plan_keys ENABLE ROW LEVEL SECURITY;
"""),
    # What an orchestrator launched for a version, under its own key (batchline.store.launches):
    # a retried task finds its launch and launches nothing twice. Written by the owner's
    # role only: no worker reads or writes it.
    (23, "launch records", """
CREATE TABLE launches (
    version text NOT NULL,
    key text NOT NULL,
    launcher text NOT NULL,
    state text NOT NULL CHECK (state IN ('intent', 'launched', 'stopped')),
    by text NOT NULL,
    created_at float8 NOT NULL,
    detail jsonb,
    launched_at float8,
    stopped_at float8,
    stop_reason text,
    PRIMARY KEY (version, key)
);
ALTER TABLE launches ENABLE ROW LEVEL SECURITY;
"""),
    # The orchestrator's task run that launched a version: its lineage events name it as their
    # parent, so a lineage server shows the scheduler's graph and batchline's as one.
    (24, "the lineage parent of a version", """
ALTER TABLE jobs ADD COLUMN lineage_parent jsonb;
"""),
    # Where the input's bytes live (batchline.store.replicas): each replica's own pins, checked
    # equal to the primary's; each shard's home region and the region of the worker that
    # claimed it last; what each worker read from outside its region.
    (25, "regions: replicas, home regions, bytes across regions", """
CREATE TABLE replicas (
    version text NOT NULL,
    region text NOT NULL,
    location text NOT NULL,
    root text NOT NULL,
    pins jsonb NOT NULL,
    compared text NOT NULL,
    by text NOT NULL,
    added_at float8 NOT NULL,
    PRIMARY KEY (version, region)
);
ALTER TABLE replicas ENABLE ROW LEVEL SECURITY;
ALTER TABLE shards ADD COLUMN home text, ADD COLUMN ran_in text;
ALTER TABLE worker_beats ADD COLUMN region text, ADD COLUMN cross_region_bytes bigint NOT NULL DEFAULT 0;
-- A claim's seeks (postgres_sql._pick): the lowest ready shard, of any home or of one; the lease
-- that expires first; the batch due first; and whether a region has a shard left to do.
CREATE INDEX shards_ready ON shards (version, shard_no) WHERE state = 'ready';
CREATE INDEX shards_ready_home ON shards (version, home, shard_no) WHERE state = 'ready';
CREATE INDEX shards_expiring ON shards (version, lease_expires) WHERE state = 'leased';
CREATE INDEX shards_due ON shards (version, poll_at) WHERE state = 'submitted';
CREATE INDEX shards_open_home ON shards (version, home) WHERE state IN ('ready', 'leased', 'submitted');
""" + _SHARD_FENCE_25),
    # A heartbeat's interval is bounded as the worker's environment bounds it (batchline.store.beats):
    # a worker's role that declares a year is refused by the database itself, not only by
    # batchline's own worker. The rows already there are brought within the bounds first, so the
    # constraint holds for every row and the capacity read needs no clamp of its own.
    (26, "heartbeat intervals within their bounds", f"""
UPDATE worker_beats SET every_s = LEAST(GREATEST(every_s, {HEARTBEAT_MIN_SECONDS}), {HEARTBEAT_MAX_SECONDS})
WHERE NOT (every_s >= {HEARTBEAT_MIN_SECONDS} AND every_s <= {HEARTBEAT_MAX_SECONDS});
ALTER TABLE worker_beats ADD CONSTRAINT "{HEARTBEAT_BOUND}"
    CHECK (every_s >= {HEARTBEAT_MIN_SECONDS} AND every_s <= {HEARTBEAT_MAX_SECONDS});
"""),
    # A worker never chooses who reads a result (I8, batchline.store.rights): every plan keeps each
    # record's ACL, each distinct ACL once a version (`acls`) and its number per record, and every
    # reader reads it from there; each record's piece, so the database knows which shard covers
    # it after a split; a lease's key (its SHA-256), known to its holder alone. Versions planned
    # before keep the ACL their records, results or dead letters held, in that order. The fences
    # themselves are rendered from batchline.store.rights (`FENCES`) and installed by the owner
    # after the migrations (postgres.PostgresStore._migrate), not here.
    (27, "ACLs kept by the plan, record pieces, lease keys", """
CREATE TABLE acls (
    version text NOT NULL,
    acl_no int NOT NULL,
    acl text NOT NULL,
    PRIMARY KEY (version, acl_no)
);
ALTER TABLE acls ENABLE ROW LEVEL SECURITY;
ALTER TABLE records ADD COLUMN acl_no int, ADD COLUMN piece int;
ALTER TABLE shards ADD COLUMN lease_key text;
CREATE TEMP TABLE planned_acl ON COMMIT DROP AS
SELECT p.version, p.record_id, COALESCE(p.acl, r.acl, d.acl) AS acl
FROM records p
LEFT JOIN results r ON r.version = p.version AND r.record_id = p.record_id
LEFT JOIN dead_letters d ON d.version = p.version AND d.record_id = p.record_id;
INSERT INTO acls (version, acl_no, acl)
SELECT version, (row_number() OVER (PARTITION BY version ORDER BY acl) - 1)::int, acl
FROM (SELECT DISTINCT version, acl FROM planned_acl WHERE acl IS NOT NULL) d;
UPDATE records p SET acl_no = a.acl_no
FROM planned_acl x JOIN acls a ON a.version = x.version AND a.acl = x.acl
WHERE p.version = x.version AND p.record_id = x.record_id;
ALTER TABLE records DROP COLUMN acl;
"""),
    # What the fences and the readers look up of a record by its id (its piece, planned shard and
    # ACL) kept in its key's index, so a probe reads the index alone once the planner has vacuumed
    # the version's records (postgres.PostgresStore._planned); and the records of a shard's slice
    # found by piece, so a shard's outcomes meet their planned ACLs in one hash join.
    (28, "record probes read the key's index alone; records by piece", """
ALTER TABLE records DROP CONSTRAINT records_pkey,
    ADD PRIMARY KEY (version, record_id) INCLUDE (piece, shard_no, acl_no);
CREATE INDEX records_by_piece ON records (version, piece);
"""),
    # Who the store is, whatever its URL (a host renamed, a password changed): the targets it
    # publishes into record it, and refuse a publish from any other store (targets/owner.py).
    (29, "the store's identity", """
CREATE TABLE store_identity (
    one int PRIMARY KEY CHECK (one = 1),
    id text NOT NULL
);
INSERT INTO store_identity (one, id) VALUES (1, gen_random_uuid()::text);
"""),
    # Where the name's pointer was when a scheduled run first planned (its latest publication,
    # NULL for none): that run publishes only from there, so a cleared old run never moves the
    # pointer past a newer night's. Keys made before it was kept say so (`pointer_kept`).
    (30, "the pointer a scheduled run planned from", """
ALTER TABLE plan_keys ADD COLUMN pointer_kept boolean NOT NULL DEFAULT false,
    ADD COLUMN pointer_publication bigint;
"""),
]

SCHEMA_VERSION = MIGRATIONS[-1][0]


# --- the fences (batchline.store.rights) ---------------------------------------------------
#
# Triggers, not row-level security: a policy sees only the new row, and these rules compare it
# with the old one (shards) or with other tables (an outcome with its shard, job and planned
# record). They hold every role that is not (a member of) the table's owner; the owner
# (planning, carrying, resuming) is not held. An outcome's rules run once per statement, as
# one query over the rows it added (a transition table), not once per row. They are rendered
# from batchline.store.rights and installed by the owner whenever their text changes
# (`FENCES_DIGEST`, kept as the outcome fence's comment), so a rule is one change there.

# The SHA-256 of the lease key the writing transaction presented (`HELD` sets it).
_PRESENTED_KEY = ("encode(sha256(convert_to(COALESCE(current_setting('batchline.lease_key', true), ''), "
                  "'UTF8')), 'hex')")
_NOT_OWNER = "NOT pg_has_role(current_user, (SELECT relowner FROM pg_class WHERE oid = TG_RELID), 'MEMBER')"


# What the outcome fence counts of the rows a statement added, per table (`n.*`, from the rows
# of one lease): a result computed by a worker (a carried one is the planner's, which counts it),
# a dead letter a worker wrote (not the planner's own).
_OUTCOME_COUNTS = {
    "results": ("a.origin IS NULL", "count(*) AS n, COALESCE(sum(a.input_tokens), 0) AS tin, "
                                    "COALESCE(sum(a.output_tokens), 0) AS tout",
                "results_count = results_count + n.n, input_tokens = input_tokens + n.tin, "
                "output_tokens = output_tokens + n.tout"),
    "dead_letters": ("a.worker IS NOT NULL", "count(*) AS n", "dead_count = dead_count + n.n"),
}


def _outcome_fence(function: str, table: str) -> str:
    """The statement trigger's function on `table` (results or dead_letters)."""
    computed, counts, counters = _OUTCOME_COUNTS[table]
    # In the record rules `s` is the lease's row as the lease rules read it (a plpgsql record).
    lease_refusal = rights.first_refusal(rights.LEASE_RULES, key="presented")
    record_refusal = rights.first_refusal(rights.RECORD_RULES, key="presented")
    return f"""
CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    n record;
    s record;
    seen record;
    bad record;
    presented text := {_PRESENTED_KEY};
    held boolean := {_NOT_OWNER};
    -- The piece after the highest the writer says its rows are of (`_FENCED`): read only for
    -- records planned without pieces (before they were kept), whose pieces the store cannot know.
    said int := NULLIF(current_setting('batchline.past_piece', true), '')::int;
BEGIN
    -- Once for each lease the statement wrote under (nearly always one), with the lease rules:
    -- every row a held role added, and what a worker computed under the owner's role. The owner's
    -- own rows (carried results, the planner's dead letters) are neither held nor counted here.
    FOR n IN SELECT n.*, {lease_refusal} AS why, s.first_piece, s.end_piece
             FROM (SELECT a.version, a.shard_no, a.worker, a.epoch, {counts} FROM added a WHERE held OR {computed}
                   GROUP BY a.version, a.shard_no, a.worker, a.epoch) n
             LEFT JOIN jobs j ON j.version = n.version
             LEFT JOIN shards s ON s.version = n.version AND s.shard_no = n.shard_no LOOP
        IF held AND n.why IS NOT NULL THEN
            RAISE EXCEPTION '% for record % of %: refused: %', TG_ARGV[0],
                (SELECT min(a.record_id) FROM added a WHERE a.version = n.version AND a.shard_no = n.shard_no),
                n.version, n.why USING ERRCODE = 'insufficient_privilege';
        END IF;
        -- What the record rules read of the shard (`s`): its slice, as the lease rules found it.
        s := n;
        -- The record rules, in one statement over the lease's rows: each a probe of the version's
        -- planned records, which reads the key's index alone.
        SELECT min(CASE WHEN held AND {record_refusal} IS NOT NULL THEN a.record_id END) AS record_id,
               max(p.piece) AS top, bool_or(p.piece IS NULL) AS unpieced INTO seen
        FROM added a LEFT JOIN records p ON p.version = n.version AND p.record_id = a.record_id
        WHERE a.version = n.version AND a.shard_no = n.shard_no AND a.worker = n.worker AND a.epoch = n.epoch;
        IF seen.record_id IS NOT NULL THEN
            SELECT {record_refusal} AS why INTO bad
            FROM (SELECT 1) one LEFT JOIN records p ON p.version = n.version AND p.record_id = seen.record_id;
            RAISE EXCEPTION '% for record % of %: refused: %', TG_ARGV[0], seen.record_id, n.version, bad.why
                USING ERRCODE = 'insufficient_privilege';
        END IF;
        -- The shard counts what was added, whatever statement added it: a bare INSERT cannot leave
        -- an outcome its shard does not count (which no completion could then match). And a split
        -- never moves a piece that has an outcome: the pieces started run past the highest answered.
        UPDATE shards SET {counters},
               started_piece = GREATEST(COALESCE(started_piece, first_piece), seen.top + 1,
                                        CASE WHEN seen.unpieced THEN LEAST(said, s.end_piece) END)
        WHERE version = n.version AND shard_no = n.shard_no;
    END LOOP;
    RETURN NULL;
END $$;
"""


def _fences() -> str:
    shard_rules = "\n".join(
        f"    {'IF' if i == 0 else 'ELSIF'} {rule.sql.format(key=_PRESENTED_KEY, now='now_s')} THEN\n"
        f"        why := '{rule.why.replace(chr(39), chr(39) * 2)}';"
        for i, rule in enumerate(rights.SHARD_RULES))
    outcome_fences = _outcome_fence("batchline_outcome_fence", "results") + _outcome_fence(
        "batchline_dead_letter_fence", "dead_letters")
    paid = "\n".join(f"    NEW.{column} := {value.format(now='batchline_now()')};"
                      for column, value in rights.PAID_TIMES)
    insert = rights.SHARD_INSERT_RULE
    return f"""
CREATE OR REPLACE FUNCTION batchline_shard_fence() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    why text;
    now_s float8 := batchline_now();
BEGIN
    IF NOT ({_NOT_OWNER}) THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'INSERT' THEN
        IF {insert.sql} THEN
            why := '{insert.why.replace(chr(39), chr(39) * 2)}';
        END IF;
    ELSE
{shard_rules}
    END IF;
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'shard % of %: %', COALESCE(NEW.shard_no, OLD.shard_no), COALESCE(NEW.version, OLD.version),
            why USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS shards_fence ON shards;
CREATE TRIGGER shards_fence BEFORE INSERT OR UPDATE ON shards
    FOR EACH ROW EXECUTE FUNCTION batchline_shard_fence();

{outcome_fences}DROP TRIGGER IF EXISTS results_fence ON results;
CREATE TRIGGER results_fence AFTER INSERT ON results REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION batchline_outcome_fence('a result');
DROP TRIGGER IF EXISTS dead_letters_fence ON dead_letters;
CREATE TRIGGER dead_letters_fence AFTER INSERT ON dead_letters REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION batchline_dead_letter_fence('a dead letter');

CREATE OR REPLACE FUNCTION batchline_paid_times() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
{paid}
    RETURN NEW;
END $$;
"""


FENCES = _fences()
FENCES_DIGEST = hashlib.sha256(FENCES.encode()).hexdigest()[:16]
FENCES_INSTALLED = "SELECT obj_description(to_regproc('batchline_outcome_fence'), 'pg_proc')"
FENCES_MARK_TEXT = f"batchline fences {FENCES_DIGEST}"
FENCES_MARK = f"COMMENT ON FUNCTION batchline_outcome_fence() IS '{FENCES_MARK_TEXT}'"

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
# Where the views named after published jobs live: never among the store's tables.
PUBLISHED_SCHEMA = "published"


# --- what a worker may do ------------------------------------------------------------------
#
# Every statement a worker runs is declared here with the access it needs, beside
# its text; `batchline grants` gives the worker role exactly the union of these
# (and row-level security keeps it to its version's rows), so a statement that
# writes a new column cannot run under the role until its declaration says so.


@dataclass(frozen=True)
class Access:
    table: str
    privilege: str  # SELECT | INSERT | UPDATE
    columns: tuple[str, ...] = ()


class WorkerStatement(str):
    """A statement a worker runs, carrying the table access it needs."""

    access: tuple[Access, ...]

    def __new__(cls, text: str, *access: Access) -> WorkerStatement:
        statement = super().__new__(cls, text)
        statement.access = access
        return statement


def reads(*tables: str) -> tuple[Access, ...]:
    return tuple(Access(t, "SELECT") for t in tables)


def inserts(table: str) -> Access:
    return Access(table, "INSERT")


def updates(table: str, *columns: str) -> Access:
    return Access(table, "UPDATE", columns)


def worker_statements() -> dict[str, WorkerStatement]:
    return {name: value for name, value in globals().items() if isinstance(value, WorkerStatement)}


OPEN_STATES = "('ready', 'leased', 'submitted')"
FENCE = ("version = %(v)s AND shard_no = %(s)s AND owner = %(w)s AND epoch = %(e)s "
         "AND state = 'leased'")
# A write by the lease's holder (batchline.store.rights): its key's hash matches, and the key is
# set in the transaction for the fences to compare (a trigger sees no statement's parameters).
HELD = (f"{FENCE} AND lease_key = %(kh)s "
        f"AND set_config('batchline.lease_key', %(k)s, true) IS NOT NULL")
# An outcome is written only while its version is open (sealed, halted or cancelled refuse it).
_OPEN_JOB = "EXISTS (SELECT 1 FROM jobs WHERE version = %(v)s AND state = 'ready')"
ROUTES = "(%(routes)s::text[] IS NULL OR s.route = ANY(%(routes)s::text[]))"

# --- clock -------------------------------------------------------------------------

NOW = WorkerStatement("SELECT batchline_now()", *reads("clock"))
STORE_IDENTITY = "SELECT id FROM store_identity"
SHIFT_CLOCK = "UPDATE clock SET offset_s = offset_s + %(seconds)s WHERE id = 1"

# --- events ------------------------------------------------------------------------

INSERT_EVENT = WorkerStatement(
    "INSERT INTO events (version, ts, kind, worker, shard_no, epoch, detail, op) "
    "VALUES (%(v)s, batchline_now(), %(kind)s, %(w)s, %(s)s, %(e)s, %(detail)s, %(op)s)",
    inserts("events"), *reads("clock"))
# Events are read back only to learn whether a write retried after a lost connection committed.
EVENTS_BY_OP = WorkerStatement(
    "SELECT kind, version, shard_no, epoch, detail FROM events WHERE op = %(op)s ORDER BY id", *reads("events"))
_EVENT_COLUMNS = "SELECT id, version, ts, kind, worker, shard_no, epoch, detail FROM events"
_KINDS = "(%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))"
EVENTS = f"{_EVENT_COLUMNS} WHERE version = %(v)s AND {_KINDS} ORDER BY id"
ALL_EVENTS = f"{_EVENT_COLUMNS} WHERE {_KINDS} ORDER BY id"

# --- jobs and planning ----------------------------------------------------------------

_JOB_COLUMNS = ("version, name, state, spec, record_count, shard_count, created_at, sealed_at, carried_count, "
                "abort_rate, abort_min, halt, planned_dead, opened_at")
JOB = WorkerStatement(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE version = %(v)s", *reads("jobs"))
JOBS = (f"SELECT {_JOB_COLUMNS} FROM jobs WHERE state IN ('ready', 'halted', 'sealed', 'cancelled') "
        f"ORDER BY created_at")
PLAN_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%(key)s, 0))"
JOB_STATE_FOR_UPDATE = "SELECT state FROM jobs WHERE version = %(v)s FOR UPDATE"
INSERT_JOB = ("INSERT INTO jobs (version, name, state, spec, plan_token, created_at) "
              "VALUES (%(v)s, %(name)s, 'planning', %(spec)s, %(token)s, batchline_now())")
DELETE_PLANNING = tuple(f"DELETE FROM {table} WHERE version = %(v)s" for table in (
    *PARTITIONED, "acls", "shards", "attempts", "events", "jobs"))
PLAN_TOKEN = "SELECT plan_token FROM jobs WHERE version = %(v)s AND state = 'planning' FOR SHARE"
PLAN_TOKEN_ANY = "SELECT plan_token FROM jobs WHERE version = %(v)s FOR UPDATE"
INSERT_SHARD = ("INSERT INTO shards (version, shard_no, slice, record_count, state, route, first_piece, end_piece, "
                "home) VALUES (%(v)s, %(s)s, %(slice)s, %(n)s, 'ready', %(route)s, %(first)s, %(end)s, %(home)s)")
COPY_RECORDS = ("COPY records (version, record_id, shard_no, content_hash, carry, text_hash, acl_no, piece) "
                "FROM STDIN")
COPY_RECORDS_WITH_INPUT = ("COPY records (version, record_id, shard_no, content_hash, carry, text_hash, acl_no, piece, "
                           "text, position) FROM STDIN")
INSERT_ACL = "INSERT INTO acls (version, acl_no, acl) VALUES (%(v)s, %(n)s, %(acl)s)"
RECORD_SHARD = "SELECT shard_no FROM records WHERE version = %(v)s AND record_id = %(r)s"
PLAN_DEAD_LETTER = """
INSERT INTO dead_letters (version, record_id, shard_no, kind, error, attempts, created_at)
VALUES (%(v)s, %(r)s, %(s)s, %(kind)s, %(error)s, 0, batchline_now())"""
BUMP_DEAD = "UPDATE shards SET dead_count = dead_count + %(n)s WHERE version = %(v)s AND shard_no = %(s)s"
# Every dead letter there is at planning is the planner's own.
COMMIT_PLAN = ("UPDATE jobs SET state = 'ready', record_count = %(records)s, shard_count = %(shards)s, "
               "plan_token = NULL, abort_rate = %(abort_rate)s, abort_min = %(abort_min)s, "
               "planned_dead = (SELECT count(*) FROM dead_letters WHERE version = %(v)s) WHERE version = %(v)s")
# Sealing is the one change a worker makes to its job: the completion of the last shard.
SEAL = WorkerStatement(f"""
UPDATE jobs SET state = 'sealed', sealed_at = batchline_now()
WHERE version = %(v)s AND state = 'ready'
  AND NOT EXISTS (SELECT 1 FROM shards WHERE version = %(v)s AND state IN {OPEN_STATES})
RETURNING version""", updates("jobs", "state", "sealed_at"), *reads("jobs", "shards", "clock"))
# Completions of one version take the job's row lock only at the end, so the one
# that finishes the last open shard sees (in SEAL's fresh snapshot, after the
# lock) every other completion committed, and seals exactly once.
LOCK_JOB = WorkerStatement("SELECT 1 FROM jobs WHERE version = %(v)s FOR NO KEY UPDATE",
                           updates("jobs", "state", "sealed_at"), *reads("jobs"))

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
JOIN records p ON p.version = %(base)s AND p.record_id = n.record_id
JOIN results b ON b.version = %(base)s AND b.record_id = n.record_id
WHERE n.version = %(v)s AND (p.content_hash = n.content_hash
                             OR COALESCE(p.text_hash, p.content_hash) = COALESCE(n.text_hash, n.content_hash))"""
# One pass over the carried rows, not one per shard.
CARRY_COUNTS = """
UPDATE shards s SET results_count = s.results_count + c.n, carried = s.carried + c.n
FROM (SELECT shard_no, count(*) AS n FROM results WHERE version = %(v)s AND origin IS NOT NULL
      GROUP BY shard_no) c
WHERE s.version = %(v)s AND s.shard_no = c.shard_no"""
SET_CARRIED = "UPDATE jobs SET carried_count = %(n)s WHERE version = %(v)s"
CARRY_DONE = ("UPDATE shards SET state = 'done', done_at = batchline_now() WHERE version = %(v)s "
              "AND results_count + dead_count = record_count")

# --- leases --------------------------------------------------------------------------

READY_JOBS = WorkerStatement("SELECT version FROM jobs WHERE state = 'ready' ORDER BY created_at", *reads("jobs"))
OPEN_VERSIONS = WorkerStatement(f"""
SELECT j.version FROM jobs j
WHERE j.state = 'ready'
  AND EXISTS (SELECT 1 FROM shards s WHERE s.version = j.version AND s.state IN {OPEN_STATES})
ORDER BY j.created_at""", *reads("jobs", "shards"))

# The lowest claimable shard, skipping rows other claimers hold locked right now (they are
# being granted, and waiting on them would make claimers queue on each other). One index seek
# per way a shard can be claimable: the lowest ready shard; the lowest of the expired leases and
# of the batches due (found by their times, so only those are read); then the lowest of the
# three. One filter over every open shard in order instead walked past each live lease on every
# claim: with a thousand workers, a thousand rows a claim.
def _pick(home: bool) -> WorkerStatement:
    where = f"s.version = %(v)s AND {ROUTES}" + (" AND s.home = %(home)s" if home else "")
    # A locking clause is not allowed in a member of a UNION: each seek is a CTE of its own. The
    # `+ 0` keeps the planner from walking the open shards in number order to find the expired
    # ones: it seeks them by time, then sorts the few it found.
    return WorkerStatement(f"""
WITH ready AS (
    SELECT s.* FROM shards s WHERE {where} AND s.state = 'ready'
    ORDER BY s.shard_no LIMIT 1 FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT s.* FROM shards s WHERE {where} AND s.state = 'leased' AND s.lease_expires <= batchline_now()
    ORDER BY s.shard_no + 0 LIMIT 1 FOR UPDATE SKIP LOCKED
), due AS (
    SELECT s.* FROM shards s WHERE {where} AND s.state = 'submitted' AND s.poll_at <= batchline_now()
    ORDER BY s.shard_no + 0 LIMIT 1 FOR UPDATE SKIP LOCKED
)
SELECT c.shard_no, c.state, c.owner, c.epoch, c.slice, c.record_count, c.route, c.batch, batchline_now(),
       j.lease_seconds, c.first_piece, c.end_piece, c.home
FROM (SELECT * FROM ready UNION ALL SELECT * FROM expired UNION ALL SELECT * FROM due) c
JOIN jobs j ON j.version = c.version
WHERE j.state = 'ready'
ORDER BY c.shard_no
LIMIT 1""", *reads("shards", "jobs", "clock"))


PICK_SHARD = _pick(home=False)
ANALYZE_SHARDS = "ANALYZE shards"
# A worker's own region's shards (input.regions): the same, among the shards whose home it is.
PICK_HOME_SHARD = _pick(home=True)
GRANT_SHARD = WorkerStatement("""
UPDATE shards SET state = 'leased', owner = %(w)s, epoch = epoch + 1, lease_expires = %(expires)s,
                  claims = claims + 1, owner_process = %(process)s, ran_in = %(region)s, lease_key = %(kh)s
WHERE version = %(v)s AND shard_no = %(s)s
RETURNING epoch, lease_expires""",
    updates("shards", "state", "owner", "epoch", "lease_expires", "claims", "owner_process", "ran_in", "lease_key"),
    *reads("shards"))
# Whether a region has a shard not done yet (ready, or leased by a worker that may yet give it up).
HOME_OPEN = WorkerStatement(
    f"SELECT 1 FROM shards s WHERE s.version = %(v)s AND s.home = %(home)s AND s.state IN {OPEN_STATES} "
    f"AND {ROUTES} LIMIT 1", *reads("shards"))
SHARD_SLICE = "SELECT slice FROM shards WHERE version = %(v)s AND shard_no = %(s)s"
LEASE_BY_CLAIM = WorkerStatement(
    "SELECT slice, record_count, lease_expires, route, batch, first_piece, end_piece, home FROM shards "
    "WHERE version = %(v)s AND shard_no = %(s)s", *reads("shards"))
# A renewal also records how far the owner has got (the first piece it has not
# started), which is where a split of its tail may begin.
RENEW = WorkerStatement("""
UPDATE shards s SET lease_expires = batchline_now() + j.lease_seconds,
                    started_piece = GREATEST(COALESCE(s.started_piece, s.first_piece),
                                             COALESCE(%(started)s::int, s.first_piece))
FROM jobs j
WHERE j.version = s.version AND s.version = %(v)s AND s.shard_no = %(s)s AND s.owner = %(w)s
  AND s.epoch = %(e)s AND s.state = 'leased' AND s.lease_key = %(kh)s
  AND set_config('batchline.lease_key', %(k)s, true) IS NOT NULL
RETURNING s.lease_expires, s.end_piece, s.record_count""", updates("shards", "lease_expires", "started_piece"),
    *reads("shards", "jobs", "clock"))
# A batch already at the provider is not given up with the lease: the shard
# waits there for the next poller, who must not submit it again.
RELEASE = WorkerStatement(f"""
UPDATE shards SET state = CASE WHEN batch ->> 'batch_id' IS NOT NULL THEN 'submitted' ELSE 'ready' END,
                  owner = NULL, lease_expires = NULL, poll_at = batchline_now()
WHERE {HELD}""", updates("shards", "state", "owner", "lease_expires", "poll_at"), *reads("shards", "clock"))
SET_BATCH = WorkerStatement(f"UPDATE shards SET batch = %(batch)s WHERE {HELD}",
                            updates("shards", "batch"), *reads("shards"))
SHARD_FOR_AWAIT = WorkerStatement(
    "SELECT state, owner, epoch, batch FROM shards WHERE version = %(v)s AND shard_no = %(s)s FOR NO KEY UPDATE",
    updates("shards", "state"), *reads("shards"))
AWAIT_PROVIDER = WorkerStatement(f"""
UPDATE shards SET state = 'submitted', batch = %(batch)s, lease_expires = NULL,
                  poll_at = batchline_now() + %(poll_in)s
WHERE {HELD}""", updates("shards", "state", "batch", "lease_expires", "poll_at"), *reads("shards", "clock"))
SHARD_FOR_COMPLETE = WorkerStatement(
    "SELECT state, owner, epoch, record_count, results_count, dead_count FROM shards "
    "WHERE version = %(v)s AND shard_no = %(s)s FOR NO KEY UPDATE", updates("shards", "state"), *reads("shards"))
FINISH_SHARD = WorkerStatement(
    f"UPDATE shards SET state = 'done', done_at = batchline_now(), lease_expires = NULL, files = %(files)s "
    f"WHERE {HELD}", updates("shards", "state", "done_at", "lease_expires", "files"),
    *reads("shards", "clock"))
_OPEN_OF_READY = (f"SELECT 1 FROM shards s JOIN jobs j ON j.version = s.version WHERE j.state = 'ready' "
                  f"AND s.state IN {OPEN_STATES} AND {ROUTES}")
HAS_OPEN = WorkerStatement(f"SELECT EXISTS ({_OPEN_OF_READY})", *reads("shards", "jobs"))
HAS_OPEN_VERSION = WorkerStatement(f"SELECT EXISTS ({_OPEN_OF_READY} AND s.version = %(v)s)",
                                   *reads("shards", "jobs"))

# --- halting on dead letters ------------------------------------------------------------

JOB_HALT = WorkerStatement("SELECT state, halt FROM jobs WHERE version = %(v)s", *reads("jobs"))
# The version's bound and the outcomes it computed: results less those carried, dead
# letters less the planner's. One pass over the version's shards, whatever its size.
DEAD_LETTER_FIGURES = WorkerStatement("""
SELECT j.state, j.abort_rate, j.abort_min,
       (SELECT COALESCE(sum(results_count - carried), 0) FROM shards WHERE version = %(v)s),
       (SELECT COALESCE(sum(dead_count), 0) FROM shards WHERE version = %(v)s) - j.planned_dead
FROM jobs j WHERE j.version = %(v)s""", *reads("jobs", "shards"))
# Read once, when the version is halted.
DOMINANT_DEAD_KIND = WorkerStatement("""
SELECT kind, count(*), min(record_id) FROM dead_letters WHERE version = %(v)s AND worker IS NOT NULL
GROUP BY kind ORDER BY count(*) DESC, kind LIMIT 1""", *reads("dead_letters"))
# Halting is the other change a worker makes to its job (from ready to halted).
HALT_JOB = WorkerStatement(
    "UPDATE jobs SET state = 'halted', halt = %(halt)s WHERE version = %(v)s AND state = 'ready'",
    updates("jobs", "state", "halt"), *reads("jobs"))
RESUME_JOB = ("UPDATE jobs SET state = 'ready', halt = NULL, abort_rate = %(abort_rate)s, abort_min = %(abort_min)s "
              "WHERE version = %(v)s AND state = 'halted'")

# --- records --------------------------------------------------------------------------

ANSWERED = WorkerStatement("""
SELECT record_id FROM results WHERE version = %(v)s AND record_id = ANY(%(ids)s)
UNION ALL
SELECT record_id FROM dead_letters WHERE version = %(v)s AND record_id = ANY(%(ids)s)""",
    *reads("results", "dead_letters"))
# A shard's input where the store holds it (a job over a published job), by position: the
# one read of the planned records a worker makes, of its own version's rows.
INPUT_RECORDS = WorkerStatement(
    "SELECT p.record_id, p.text, a.acl, p.content_hash, p.position FROM records p "
    "LEFT JOIN acls a ON a.version = p.version AND a.acl_no = p.acl_no WHERE p.version = %(v)s "
    "AND p.position >= %(start)s AND p.position < %(end)s ORDER BY p.position", *reads("records", "acls"))
ATTEMPTS = WorkerStatement(
    "SELECT record_id, attempts FROM attempts WHERE version = %(v)s AND record_id = ANY(%(ids)s)",
    *reads("attempts"))

FENCE_LOCK = WorkerStatement(f"SELECT first_piece, end_piece, {_OPEN_JOB} FROM shards WHERE {HELD} "
                             f"FOR NO KEY UPDATE",
                             updates("shards", "state"), *reads("shards", "jobs"))
LEASE_HOLDERS = WorkerStatement(
    "SELECT shard_no, owner, epoch, lease_expires, owner_process FROM shards "
    "WHERE version = %(v)s AND state = 'leased' ORDER BY shard_no", *reads("shards"))
TAKE_BACK = WorkerStatement(f"""
UPDATE shards SET state = CASE WHEN batch ->> 'batch_id' IS NOT NULL THEN 'submitted' ELSE 'ready' END,
                  owner = NULL, epoch = epoch + 1, lease_expires = NULL, poll_at = batchline_now()
WHERE {FENCE}""", updates("shards", "state", "owner", "epoch", "lease_expires", "poll_at"),
    *reads("shards", "clock"))
# The leased local shard with the longest unstarted tail, whose owner's lease is current, holding no
# carried results (see the SQLite module).
SPLIT_CANDIDATE = WorkerStatement("""
SELECT shard_no, owner, epoch, slice, first_piece, end_piece, started_piece, home FROM shards
WHERE version = %(v)s AND state = 'leased' AND route = 'local' AND end_piece IS NOT NULL
  AND lease_expires > batchline_now() AND carried = 0
ORDER BY end_piece - GREATEST(COALESCE(started_piece, first_piece), first_piece) DESC, shard_no
LIMIT 1 FOR NO KEY UPDATE SKIP LOCKED""", updates("shards", "state"), *reads("shards", "clock"))
NEXT_SHARD_NO = WorkerStatement("SELECT COALESCE(max(shard_no), -1) + 1 FROM shards WHERE version = %(v)s",
                                *reads("shards"))
SHRINK_SHARD = WorkerStatement(
    "UPDATE shards SET end_piece = %(end)s, record_count = record_count - %(records)s, "
    "dead_count = dead_count - %(dead)s WHERE version = %(v)s AND shard_no = %(s)s AND end_piece = %(old_end)s",
    updates("shards", "end_piece", "record_count", "dead_count"), *reads("shards"))
SPLIT_SHARD = WorkerStatement(
    "INSERT INTO shards (version, shard_no, slice, record_count, state, route, dead_count, first_piece, end_piece, "
    "home) VALUES (%(v)s, %(new)s, %(slice)s, %(records)s, 'ready', 'local', %(dead)s, %(first)s, %(end)s, %(home)s)",
    inserts("shards"))

# A put commits without waiting for its WAL flush (synchronous_commit off for
# this transaction only): the commit that costs most per row, and the one whose
# loss is harmless. WAL is flushed in order, so the shard's completion, which
# does wait, cannot be durable unless every put before it is; a server crash
# loses at most the last fraction of a second of puts, the shard then cannot
# complete (its count is short), and after its lease those records are done again.
#
# One statement per flush: the fence proves the lease (its key set for the database's
# fences) and takes the shard row's lock, so no claim can take the shard over until this
# commits; it inserts only while the version is open, and only the rows of pieces the shard
# still covers (`within`: a split may have moved its tail since they were computed). It
# answers whether the lease was held, whether the version was open, and how many rows were
# new. The rows come from `source`, and the database's outcome fence (`FENCES`) checks them
# and moves the shard's counters and its pieces started in the same statement.
#
# An outcome carries no ACL: every reader takes a record's from its plan (`acls`), so what a
# worker says of one is not even sent (the `acl` columns of results and dead letters hold only
# what versions answered before plans kept ACLs).
_PUT_ACCESS = (inserts("results"), updates("shards", "state", "results_count", "input_tokens", "output_tokens",
                                           "started_piece"),
               *reads("shards", "results", "dead_letters", "clock", "jobs", "records"))
# What a flush says of its rows' pieces, for the outcome fence (`said`).
_SAID_PIECE = "set_config('batchline.past_piece', COALESCE(%(past_piece)s::text, ''), true)"
_FENCED = f"""
WITH fence AS (
    SELECT batchline_now() AS now, {_OPEN_JOB} AS open, first_piece, end_piece, {_SAID_PIECE}{{settings}}
    FROM shards WHERE {HELD} FOR NO KEY UPDATE
), ins AS (
    {{insert}}
    FROM fence, {{source}}
    WHERE fence.open AND {within_sql("u.piece", "fence.first_piece", "fence.end_piece")}
      AND NOT EXISTS (SELECT 1 FROM {{other}} o WHERE o.version = %(v)s AND o.record_id = u.record_id)
    ON CONFLICT (version, record_id) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM fence), COALESCE((SELECT open FROM fence), false), (SELECT count(*) FROM ins)"""


def _put_results(source: str) -> WorkerStatement:
    return WorkerStatement(_FENCED.format(settings=", set_config('synchronous_commit', 'off', true)", insert="""\
INSERT INTO results (version, record_id, shard_no, output, label, worker, epoch, attempt,
                         input_tokens, output_tokens, created_at, model)
    SELECT %(v)s, u.record_id, %(s)s, u.output, u.label, %(w)s, %(e)s, u.attempt,
           u.input_tokens, u.output_tokens, fence.now, u.model""", source=source, other="dead_letters"),
        *_PUT_ACCESS)


# The rows as arrays in parameters, for the smallest flushes.
PUT_RESULTS = _put_results("""
         unnest(%(ids)s::text[], %(outputs)s::text[], %(labels)s::text[],
                %(attempts)s::int[], %(tin)s::int[], %(tout)s::int[], %(models)s::text[], %(pieces)s::int[])
         AS u(record_id, output, label, attempt, input_tokens, output_tokens, model, piece)""")

# The COPY path of the same put, for all but the smallest flushes (it parses
# rows faster than arrays in parameters): rows go to a per-session staging
# table, then the same insert-select under the same fence. (Named apart from
# the staging table of batchline before pieces were staged, which a pooler's
# server session may still hold.)
CREATE_STAGE = """
CREATE TEMP TABLE IF NOT EXISTS put_rows (
    record_id text, output text, label text, attempt int, input_tokens int, output_tokens int, model text,
    piece int
) ON COMMIT DELETE ROWS"""
COPY_STAGE = ("COPY put_rows (record_id, output, label, attempt, input_tokens, output_tokens, model, piece) "
              "FROM STDIN (FORMAT BINARY)")
STAGE_TYPES = ["text", "text", "text", "int4", "int4", "int4", "text", "int4"]
PUT_FROM_STAGE = _put_results("put_rows u")

INSERT_DEAD = WorkerStatement(_FENCED.format(settings="", insert="""\
INSERT INTO dead_letters (version, record_id, shard_no, kind, error, attempts, worker, epoch, created_at)
    SELECT %(v)s, u.record_id, %(s)s, u.kind, u.error, u.attempts, %(w)s, %(e)s, fence.now""",
    source="""unnest(%(ids)s::text[], %(kinds)s::text[], %(errors)s::text[], %(attempts)s::int[],
                %(pieces)s::int[])
         AS u(record_id, kind, error, attempts, piece)""", other="results"),
    inserts("dead_letters"), updates("shards", "state", "dead_count", "started_piece"),
    *reads("shards", "results", "dead_letters", "clock", "jobs", "records"))

IS_ANSWERED = WorkerStatement("""
SELECT EXISTS (SELECT 1 FROM results WHERE version = %(v)s AND record_id = %(r)s)
    OR EXISTS (SELECT 1 FROM dead_letters WHERE version = %(v)s AND record_id = %(r)s)""",
    *reads("results", "dead_letters"))
CHARGE = WorkerStatement("""
INSERT INTO attempts (version, record_id, attempts, last_kind, last_error)
VALUES (%(v)s, %(r)s, 1, %(kind)s, %(error)s)
ON CONFLICT (version, record_id) DO UPDATE
SET attempts = attempts.attempts + 1, last_kind = excluded.last_kind, last_error = excluded.last_error
RETURNING attempts""", inserts("attempts"), updates("attempts", "attempts", "last_kind", "last_error"),
    *reads("attempts"))

# --- reading ---------------------------------------------------------------------------

STATUS_SHARDS = ("SELECT state, count(*), COALESCE(sum(results_count), 0), COALESCE(sum(dead_count), 0) "
                 "FROM shards WHERE version = %(v)s GROUP BY state")
DEAD_BY_KIND = "SELECT kind, count(*) FROM dead_letters WHERE version = %(v)s GROUP BY kind"
LEASES_LOST = "SELECT count(*) FROM events WHERE version = %(v)s AND kind = 'lease_expired'"
COUNT_EVENTS = "SELECT count(*) FROM events WHERE version = %(v)s AND kind = %(kind)s"
FIRST_CLAIM = "SELECT min(ts) FROM events WHERE version = %(v)s AND kind = 'claim'"
# Outcomes computed within the window (not carried results, not the planner's dead letters).
RECENT = ("SELECT (SELECT count(*) FROM results WHERE version = %(v)s AND created_at >= %(since)s "
          "AND origin IS NULL) + (SELECT count(*) FROM dead_letters WHERE version = %(v)s "
          "AND created_at >= %(since)s AND worker IS NOT NULL)")
# The newest refusal of a changed input on a shard not done that nobody has claimed since.
STOPPED_BY_INPUT = """
SELECT e.shard_no, e.detail FROM events e
JOIN shards s ON s.version = e.version AND s.shard_no = e.shard_no AND s.state <> 'done'
WHERE e.version = %(v)s AND e.kind = 'input_changed'
  AND NOT EXISTS (SELECT 1 FROM events c WHERE c.version = e.version AND c.kind = 'claim'
                  AND c.shard_no = e.shard_no AND c.id > e.id)
ORDER BY e.id DESC LIMIT 1"""
SHARD_ROWS = ("SELECT shard_no, state, owner, epoch, lease_expires, claims, record_count, results_count, "
              "dead_count, route, batch ->> 'batch_id', poll_at FROM shards WHERE version = %(v)s ORDER BY shard_no")
ROUTE_TOTALS = ("SELECT route, count(*), sum(record_count), sum(results_count), sum(carried), sum(dead_count), "
                "sum(input_tokens), sum(output_tokens) FROM shards WHERE version = %(v)s GROUP BY route")
TOKEN_TOTALS = "SELECT sum(input_tokens), sum(output_tokens) FROM shards WHERE version = %(v)s"
RESULT_HISTOGRAM = """
SELECT attempt, LEAST(GREATEST(floor((created_at - %(start)s) / %(width)s)::int, 0), %(last)s) AS bin, count(*)
FROM results WHERE version = %(v)s AND origin IS NULL GROUP BY attempt, bin"""
RUN_THROUGHPUT = """
SELECT sum((c.detail ->> 'records')::float8), sum(c.ts - k.ts)
FROM events c
JOIN events k ON k.version = c.version AND k.kind = 'claim' AND k.shard_no = c.shard_no AND k.epoch = c.epoch
WHERE c.version = %(v)s AND c.kind = 'complete'"""
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
RESULTS_PAGE = (f"SELECT {_RESULT_COLUMNS} {_RESULTS_FROM} WHERE r.version = %(v)s AND r.record_id > %(after)s "
                f"ORDER BY r.record_id LIMIT %(n)s")
COMPUTED_RESULTS_PAGE = (f"SELECT {_RESULT_COLUMNS} {_RESULTS_FROM} WHERE r.version = %(v)s "
                         f"AND r.record_id > %(after)s AND r.origin IS NULL ORDER BY r.record_id LIMIT %(n)s")
# The outputs this version computed, alone: what the gate's schema check reads of every result.
COMPUTED_OUTPUTS_PAGE = ("SELECT record_id, output FROM results WHERE version = %(v)s AND record_id > %(after)s "
                         "AND origin IS NULL ORDER BY record_id LIMIT %(n)s")
RESULTS_FOR = f"SELECT {_RESULT_COLUMNS} {_RESULTS_FROM} WHERE r.version = %(v)s AND r.record_id = ANY(%(ids)s)"
_DEAD_COLUMNS = "d.record_id, d.shard_no, d.kind, d.error, pacl.acl, d.attempts, d.worker, d.created_at"
_DEAD_FROM = "FROM dead_letters d " + _PLANNED_ACL.format(t="d")
_DEAD_PAGE = "WHERE d.version = %(v)s AND d.record_id > %(after)s ORDER BY d.record_id LIMIT %(n)s"
DEAD_LETTERS_PAGE = f"SELECT {_DEAD_COLUMNS} {_DEAD_FROM} {_DEAD_PAGE}"
# A version with output.carry: each row with its planned record's carried fields.
_CARRY_FROM = "LEFT JOIN records c ON c.version = %(v)s AND c.record_id = r.record_id"
RESULTS_PAGE_CARRY = (f"SELECT {_RESULT_COLUMNS}, c.carry {_RESULTS_FROM} {_CARRY_FROM} WHERE r.version = %(v)s "
                      f"AND r.record_id > %(after)s ORDER BY r.record_id LIMIT %(n)s")
COMPUTED_RESULTS_PAGE_CARRY = (f"SELECT {_RESULT_COLUMNS}, c.carry {_RESULTS_FROM} {_CARRY_FROM} WHERE "
                               f"r.version = %(v)s AND r.record_id > %(after)s AND r.origin IS NULL "
                               f"ORDER BY r.record_id LIMIT %(n)s")
RESULTS_FOR_CARRY = (f"SELECT {_RESULT_COLUMNS}, c.carry {_RESULTS_FROM} {_CARRY_FROM} WHERE r.version = %(v)s "
                     f"AND r.record_id = ANY(%(ids)s)")
DEAD_LETTERS_PAGE_CARRY = (f"SELECT {_DEAD_COLUMNS}, c.carry {_DEAD_FROM} LEFT JOIN records c "
                           f"ON c.version = %(v)s AND c.record_id = d.record_id {_DEAD_PAGE}")
PLANNED_PAGE = ("SELECT record_id FROM records WHERE version = %(v)s AND record_id > %(after)s "
                "ORDER BY record_id LIMIT %(n)s")
RESOLVE_NAME = "SELECT version FROM pointers WHERE name = %(name)s"
POINTERS = "SELECT name, version FROM pointers ORDER BY name"
LABEL_COUNTS = "SELECT label, count(*) FROM results WHERE version = %(v)s GROUP BY label"

# --- validation and publication -------------------------------------------------------------

# Only the join key: the statistics the coverage plans need, without sampling the outputs.
ANALYZE_PARTITION = "ANALYZE {}"
VACUUM_PARTITION = "VACUUM {}"
COUNT_RECORDS = "SELECT count(*) FROM records WHERE version = %(v)s"
COUNT_RESULTS = "SELECT count(*) FROM results WHERE version = %(v)s"
COUNT_DEAD = "SELECT count(*) FROM dead_letters WHERE version = %(v)s"
# Outcomes whose id the snapshot has (ids are unique on both sides).
MATCHED_RESULTS = """
SELECT count(*) FROM results r JOIN records p ON p.version = r.version AND p.record_id = r.record_id
WHERE r.version = %(v)s"""
MATCHED_DEAD = """
SELECT count(*) FROM dead_letters d JOIN records p ON p.version = d.version AND p.record_id = d.record_id
WHERE d.version = %(v)s"""
COUNT_BOTH = """
SELECT count(*) FROM dead_letters d WHERE d.version = %(v)s
AND EXISTS (SELECT 1 FROM results r WHERE r.version = %(v)s AND r.record_id = d.record_id)"""
# The counts in order (records, results, dead letters, results matched, dead letters
# matched, ids with both), with the settings each join wants between them. Matching
# millions of results is one hash join: probing an index per row (what the planner
# picks on freshly loaded, unvacuumed partitions) visits the heap once per row and
# takes twice as long. Dead letters are few: probing the records' and results' keys
# per dead letter beats hashing millions of rows to meet none of them. No JIT: its
# compilation of plain counts took 1.4 s at 2 million rows and saved nothing.
# Full coverage proven without a join: each table's count and two independent 64-bit XOR
# fingerprints of its ids (ids are unique within each table), and no id with both outcomes.
# Records and outcomes as different sets with equal counts and equal fingerprints would need
# their differences to cancel in 128 bits; anything else falls through to the exact joins.
_FINGERPRINT = ("SELECT count(*), COALESCE(bit_xor(hashtextextended(record_id, 0)), 0), "
                "COALESCE(bit_xor(hashtextextended(record_id, 1)), 0) FROM {table} WHERE version = %(v)s")
COVERAGE_PROOF = ("SET LOCAL jit = off", _FINGERPRINT.format(table="records"), _FINGERPRINT.format(table="results"),
                  _FINGERPRINT.format(table="dead_letters"), COUNT_BOTH)
COVERAGE_STEPS = (
    "SET LOCAL jit = off", "SET LOCAL work_mem = '256MB'",
    COUNT_RECORDS, COUNT_RESULTS, COUNT_DEAD,
    "SET LOCAL enable_nestloop = off", MATCHED_RESULTS,
    "SET LOCAL enable_nestloop = on", MATCHED_DEAD, COUNT_BOTH,
)
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
INSERT_VALIDATION = ("INSERT INTO validations (version, passed, report, ts) "
                     "VALUES (%(v)s, %(passed)s, %(report)s, batchline_now())")
LATEST_VALIDATION = "SELECT passed, report, ts FROM validations WHERE version = %(v)s ORDER BY id DESC LIMIT 1"
POINTER_FOR_UPDATE = "SELECT version FROM pointers WHERE name = %(name)s FOR UPDATE"
SET_POINTER = """
INSERT INTO pointers (name, version, updated_at) VALUES (%(name)s, %(v)s, batchline_now())
ON CONFLICT (name) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at"""
# The view named after the job reads through its pointer, so a reader's one
# statement sees the whole old version or the whole new one, never a mix.
# OR REPLACE: a view made before it had the carry column is made again (a column added at the
# end), in the publish that moves its pointer.
CREATE_VIEW = """
CREATE OR REPLACE VIEW {view} AS
SELECT r.record_id AS id, COALESCE(r.output, o.output) AS output, a.acl AS acl, r.label AS label,
       r.version AS version, c.carry AS carry
FROM pointers p
JOIN results r ON r.version = p.version
LEFT JOIN results o ON r.origin IS NOT NULL AND o.version = r.origin AND o.record_id = r.record_id
LEFT JOIN records c ON c.version = r.version AND c.record_id = r.record_id
LEFT JOIN acls a ON a.version = c.version AND a.acl_no = c.acl_no
WHERE p.name = {name}"""
VIEW_WITHOUT_CARRY = f"""
SELECT EXISTS (SELECT 1 FROM pg_views WHERE schemaname = '{PUBLISHED_SCHEMA}' AND viewname = %(name)s)
   AND NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = '{PUBLISHED_SCHEMA}'
                   AND table_name = %(name)s AND column_name = 'carry')"""
RELATION_EXISTS = "SELECT to_regclass(%(relation)s) IS NOT NULL"
IS_VIEW = f"SELECT EXISTS (SELECT 1 FROM pg_views WHERE schemaname = '{PUBLISHED_SCHEMA}' AND viewname = %(name)s)"
INSERT_PUBLICATION = """
INSERT INTO publications (name, version, previous, action, who, reason, validation, targets, ts)
VALUES (%(name)s, %(v)s, %(previous)s, %(action)s, %(who)s, %(reason)s, %(validation)s, %(targets)s,
        batchline_now())"""
# The name's latest publication: a publish or rollback refuses unless it is still the
# one its publisher read (a compare-and-set on its id, under the name's lock).
LATEST_PUBLICATION = "SELECT id, version, action, who FROM publications WHERE name = %(name)s ORDER BY id DESC LIMIT 1"
IS_SEALED = "SELECT EXISTS (SELECT 1 FROM jobs WHERE version = %(v)s AND state = 'sealed')"
PUBLICATIONS = ("SELECT id, name, version, previous, action, who, reason, validation, ts, targets FROM publications "
                "WHERE name = %(name)s ORDER BY id")
IS_PUBLISHED = "SELECT EXISTS (SELECT 1 FROM pointers WHERE version = %(v)s)"
KEY_PLAN = ("INSERT INTO plan_keys (name, key, version, created_at, pointer_kept, pointer_publication) "
            "VALUES (%(name)s, %(key)s, %(v)s, batchline_now(), true, "
            "(SELECT max(id) FROM publications WHERE name = %(name)s)) ON CONFLICT (name, key) DO NOTHING")
KEYED_POINTER = ("SELECT pointer_kept, pointer_publication FROM plan_keys WHERE name = %(name)s AND key = %(key)s")
# A scheduled run's worker slot finds the night's version by its key (its role sees its job's keys alone).
KEYED_VERSION = WorkerStatement("SELECT version FROM plan_keys WHERE name = %(name)s AND key = %(key)s",
                                *reads("plan_keys"))
PIN_RUNTIME = WorkerStatement(
    "INSERT INTO engine_runtimes (version, runtime, worker, pinned_at) VALUES (%(v)s, %(runtime)s, %(w)s, "
    "batchline_now()) ON CONFLICT (version) DO NOTHING", inserts("engine_runtimes"), *reads("clock"))
PINNED_RUNTIME = WorkerStatement("SELECT runtime, worker FROM engine_runtimes WHERE version = %(v)s",
                                 *reads("engine_runtimes"))
# Only the spec's validate section changes: what the version computes is its hash's.
SET_GATE = "UPDATE jobs SET spec = %(spec)s WHERE version = %(v)s AND state IN ('ready', 'halted', 'sealed')"
CANCEL_JOB = ("UPDATE jobs SET state = 'cancelled' WHERE version = %(v)s "
              "AND state IN ('ready', 'halted', 'sealed')")
# The epoch moves on, so the owner's next renewal or write is refused and it leaves the shard.
END_LEASES = ("UPDATE shards SET state = 'ready', owner = NULL, epoch = epoch + 1, lease_expires = NULL "
              "WHERE version = %(v)s AND state = 'leased'")
# Rows that a later version carries stay: they hold that version's payload.
REMOVE_VERSION = (
    """DELETE FROM results r WHERE r.version = %(v)s
AND NOT EXISTS (SELECT 1 FROM results c WHERE c.origin = %(v)s AND c.record_id = r.record_id)""",
    *(f"DELETE FROM {table} WHERE version = %(v)s" for table in (
        "shards", "records", "acls", "attempts", "dead_letters", "validations", "engine_runtimes")),
    "UPDATE jobs SET state = 'removed' WHERE version = %(v)s",
)

# --- what changed between versions (batchline.store.changes) ------------------------------

RESULT_ACLS = ("SELECT r.record_id, pacl.acl FROM results r " + _PLANNED_ACL.format(t="r")
               + " WHERE r.version = %(v)s AND r.record_id = ANY(%(ids)s)")
# Two versions' planned ACLs of one record, by text (each version numbers its ACLs its own way).
_ACL_PAIR = ("LEFT JOIN records pn ON pn.version = n.version AND pn.record_id = n.record_id "
             "LEFT JOIN acls an ON an.version = pn.version AND an.acl_no = pn.acl_no "
             "LEFT JOIN records po ON po.version = o.version AND po.record_id = o.record_id "
             "LEFT JOIN acls ao ON ao.version = po.version AND ao.acl_no = po.acl_no")
# A result is the same where the same version computed it (a carried one names its origin).
RESULT_CHANGES = """
SELECT count(*) FILTER (WHERE o.record_id IS NULL),
       count(*) FILTER (WHERE o.record_id IS NOT NULL AND (ao.acl IS DISTINCT FROM an.acl
                              OR COALESCE(n.origin, n.version) <> COALESCE(o.origin, o.version)))
FROM results n LEFT JOIN results o ON o.version = %(old)s AND o.record_id = n.record_id
""" + _ACL_PAIR + """
WHERE n.version = %(new)s"""
RESULTS_REMOVED = """
SELECT count(*) FROM results o WHERE o.version = %(old)s
AND NOT EXISTS (SELECT 1 FROM results n WHERE n.version = %(new)s AND n.record_id = o.record_id)"""
# The results of new whose row differs from old's: new records, another result (recomputed), another
# ACL, other carried values; and the records old has a result for and new has none.
RESULT_ROWS_CHANGED_PAGE = """
SELECT n.record_id FROM results n
LEFT JOIN results o ON o.version = %(old)s AND o.record_id = n.record_id
LEFT JOIN records cn ON cn.version = %(new)s AND cn.record_id = n.record_id
LEFT JOIN records co ON co.version = %(old)s AND co.record_id = n.record_id
LEFT JOIN acls an ON an.version = cn.version AND an.acl_no = cn.acl_no
LEFT JOIN acls ao ON ao.version = co.version AND ao.acl_no = co.acl_no
WHERE n.version = %(new)s AND n.record_id > %(after)s
  AND (o.record_id IS NULL OR ao.acl IS DISTINCT FROM an.acl
       OR COALESCE(n.origin, n.version) <> COALESCE(o.origin, o.version) OR cn.carry IS DISTINCT FROM co.carry)
ORDER BY n.record_id LIMIT %(n)s"""
RESULT_ROWS_REMOVED_PAGE = """
SELECT o.record_id FROM results o WHERE o.version = %(old)s AND o.record_id > %(after)s
AND NOT EXISTS (SELECT 1 FROM results n WHERE n.version = %(new)s AND n.record_id = o.record_id)
ORDER BY o.record_id LIMIT %(n)s"""
# The rule batchline.store.changes.record_kind states for a record not planned yet.
RECORD_CHANGES_PAGE = """
SELECT n.record_id, CASE WHEN p.record_id IS NULL THEN 'new'
                         WHEN p.content_hash = n.content_hash THEN 'unchanged'
                         WHEN COALESCE(p.text_hash, p.content_hash) = COALESCE(n.text_hash, n.content_hash)
                         THEN 'acl' ELSE 'text' END
FROM records n LEFT JOIN records p ON p.version = %(base)s AND p.record_id = n.record_id
WHERE n.version = %(v)s AND n.record_id > %(after)s ORDER BY n.record_id LIMIT %(n)s"""
RECORDS_REMOVED_PAGE = """
SELECT p.record_id FROM records p WHERE p.version = %(base)s AND p.record_id > %(after)s
AND NOT EXISTS (SELECT 1 FROM records n WHERE n.version = %(v)s AND n.record_id = p.record_id)
ORDER BY p.record_id LIMIT %(n)s"""
BASE_HASHES = """
SELECT p.record_id, p.content_hash, p.text_hash,
       EXISTS (SELECT 1 FROM results b WHERE b.version = %(v)s AND b.record_id = p.record_id)
FROM records p WHERE p.version = %(v)s AND p.record_id = ANY(%(ids)s)"""

# --- paid workers (batchline.store.paid) ---------------------------------------------------

_PAID_COLUMNS = ("slot, generation, launched_at, launched_by, cost_per_hour, worker, process, started_at, seen_at, "
                 "claimed_at, stopped_at, stop_reason")
PAID_SLOTS = f"SELECT {_PAID_COLUMNS} FROM paid_workers WHERE version = %(v)s ORDER BY slot, generation"
PAID_SLOT_LATEST = (f"SELECT {_PAID_COLUMNS} FROM paid_workers WHERE version = %(v)s AND slot = %(slot)s "
                    f"ORDER BY generation DESC LIMIT 1")
PAID_INSERT = ("INSERT INTO paid_workers (version, slot, generation, launched_at, launched_by, cost_per_hour) "
               "VALUES (%(v)s, %(slot)s, %(g)s, batchline_now(), %(by)s, %(cost)s)")
# started_at follows from seen_at (the trigger of migration 19): the worker role cannot set it.
PAID_SEEN = WorkerStatement("""
UPDATE paid_workers SET worker = %(w)s, process = %(process)s, seen_at = batchline_now(),
    claimed_at = CASE WHEN %(claimed)s AND claimed_at IS NULL THEN batchline_now() ELSE claimed_at END
WHERE version = %(v)s AND slot = %(slot)s AND generation = %(g)s AND stopped_at IS NULL
  AND (worker IS NULL OR worker = %(w)s)""",
    updates("paid_workers", "worker", "process", "seen_at", "claimed_at"),
    *reads("paid_workers", "clock"))
PAID_STOP = WorkerStatement(
    "UPDATE paid_workers SET stopped_at = batchline_now(), stop_reason = %(reason)s WHERE version = %(v)s "
    "AND slot = %(slot)s AND generation = %(g)s AND stopped_at IS NULL",
    updates("paid_workers", "stopped_at", "stop_reason"), *reads("paid_workers", "clock"))
# Worker-seconds from each start (the worker's process up) to its stop, or to now while it runs.
PAID_SPEND = ("SELECT COALESCE(SUM(COALESCE(stopped_at, batchline_now()) - started_at), 0) FROM paid_workers "
              "WHERE version = %(v)s AND started_at IS NOT NULL")
# What a paid worker holds the budget with at each heartbeat: the spend so far, and the paid
# workers that run up and unstopped (each of which spends until the next heartbeat).
PAID_BUDGET = WorkerStatement(
    "SELECT COALESCE(sum((COALESCE(stopped_at, batchline_now()) - started_at) * cost_per_hour / 3600.0), 0), "
    "COALESCE(sum(cost_per_hour) FILTER (WHERE stopped_at IS NULL), 0) "
    "FROM paid_workers WHERE version = %(v)s AND started_at IS NOT NULL", *reads("paid_workers", "clock"))

# --- the lineage outbox (batchline.store.lineage) ------------------------------------------

# --- worker heartbeats (batchline.store.beats) ----------------------------------------------

WORKER_BEAT = WorkerStatement("""
INSERT INTO worker_beats (version, worker, paid_slot, process, every_s, started_at, seen_at, region,
                          cross_region_bytes)
SELECT %(v)s, %(w)s, %(slot)s, %(process)s, %(every)s, batchline_now(), batchline_now(), %(region)s, %(cross)s
WHERE EXISTS (SELECT 1 FROM jobs WHERE version = %(v)s)
ON CONFLICT (version, worker) DO UPDATE SET seen_at = EXCLUDED.seen_at, every_s = EXCLUDED.every_s,
    cross_region_bytes = GREATEST(worker_beats.cross_region_bytes, EXCLUDED.cross_region_bytes)
WHERE worker_beats.stopped_at IS NULL""", inserts("worker_beats"),
    updates("worker_beats", "seen_at", "every_s", "cross_region_bytes"), *reads("worker_beats", "clock", "jobs"))
WORKER_GONE = WorkerStatement(
    "UPDATE worker_beats SET stopped_at = batchline_now() WHERE version = %(v)s AND worker = %(w)s "
    "AND stopped_at IS NULL", updates("worker_beats", "stopped_at"), *reads("worker_beats", "clock"))
WORKERS_SEEN = ("SELECT worker, paid_slot, process, every_s, started_at, seen_at FROM worker_beats "
                "WHERE version = %(v)s AND stopped_at IS NULL AND seen_at >= batchline_now() - %(grace)s * every_s "
                "ORDER BY worker")
# The one rule of what a heartbeat counts for (batchline.store.beats.live_capacity). Each set is
# one range seek of an index (shards_expiring, shards_done, the beats' and paid starts' keys),
# hashed and joined once: no per-worker subquery, so a thousand workers cost a few thousand rows.
LIVE_CAPACITY = """
WITH n AS (SELECT batchline_now() AS t),
leased AS (
    SELECT DISTINCT owner FROM shards
    WHERE version = %(v)s AND state = 'leased' AND lease_expires > (SELECT t FROM n)
), completed AS (
    SELECT owner, max(done_at) AS done_at FROM shards
    WHERE version = %(v)s AND state = 'done' AND done_at >= (SELECT t FROM n) - %(grace)s * %(max_every)s
    GROUP BY owner
), paid AS (
    SELECT slot || '/' || generation AS ref, worker FROM paid_workers
    WHERE version = %(v)s AND stopped_at IS NULL AND worker IS NOT NULL
), counted AS (
    SELECT b.worker, b.paid_slot, b.process, b.every_s, b.started_at, b.seen_at,
           CASE WHEN l.owner IS NOT NULL THEN 'leased'
                WHEN c.done_at >= n.t - %(grace)s * b.every_s THEN 'completed'
                WHEN b.started_at >= n.t - %(loading)s THEN 'loading' END AS why
    FROM worker_beats b CROSS JOIN n
    LEFT JOIN leased l ON l.owner = b.worker
    LEFT JOIN completed c ON c.owner = b.worker
    LEFT JOIN paid p ON p.ref = b.paid_slot AND p.worker = b.worker
    WHERE b.version = %(v)s AND b.stopped_at IS NULL AND b.seen_at >= n.t - %(grace)s * b.every_s
      AND (b.paid_slot IS NULL OR p.ref IS NOT NULL)
)
SELECT worker, paid_slot, process, every_s, started_at, seen_at, why FROM counted
WHERE why IS NOT NULL ORDER BY worker"""
# What a worker's loading allowance counts in: the paid starts' launch to first claim, else
# the spec's own restart overhead (its fallback section's).
RESTART_SPANS = ("SELECT claimed_at - launched_at FROM paid_workers WHERE version = %(v)s "
                 "AND claimed_at IS NOT NULL")
SPEC_RESTART_OVERHEAD = ("SELECT (spec -> 'fallback' ->> 'restart_overhead_seconds')::float8 FROM jobs "
                         "WHERE version = %(v)s")
# --- launch records (batchline.store.launches) ----------------------------------------------

_LAUNCH_COLUMNS = "version, key, launcher, state, by, created_at, detail, launched_at, stopped_at, stop_reason"
LAUNCH_INTENT = ("INSERT INTO launches (version, key, launcher, state, by, created_at) "
                 "VALUES (%(v)s, %(key)s, %(launcher)s, 'intent', %(by)s, batchline_now()) "
                 "ON CONFLICT (version, key) DO UPDATE SET launcher = EXCLUDED.launcher, state = 'intent', "
                 "by = EXCLUDED.by, created_at = EXCLUDED.created_at, detail = NULL, launched_at = NULL, "
                 "stopped_at = NULL, stop_reason = NULL WHERE launches.state = 'stopped'")
LAUNCH_ROW = f"SELECT {_LAUNCH_COLUMNS} FROM launches WHERE version = %(v)s AND key = %(key)s"
LAUNCH_DONE = ("UPDATE launches SET state = 'launched', detail = %(detail)s, launched_at = batchline_now() "
               "WHERE version = %(v)s AND key = %(key)s AND state <> 'stopped'")
LAUNCH_STOP = ("UPDATE launches SET state = 'stopped', stopped_at = batchline_now(), stop_reason = %(reason)s "
               "WHERE version = %(v)s AND key = %(key)s AND state <> 'stopped'")
LAUNCHES = f"SELECT {_LAUNCH_COLUMNS} FROM launches WHERE version = %(v)s ORDER BY created_at, key"

# A version a bare worker claimed before anything opened it started at that claim.
OPEN_RUN = ("UPDATE jobs SET opened_at = COALESCE((SELECT min(ts) FROM events WHERE version = %(v)s "
            "AND kind = 'claim'), batchline_now()) WHERE version = %(v)s AND opened_at IS NULL")
OPENED_AT = "SELECT opened_at FROM jobs WHERE version = %(v)s"
LINEAGE_RUN_ATTEMPT = WorkerStatement("SELECT run_attempt, run_started_at FROM jobs WHERE version = %(v)s",
                                      *reads("jobs"))
LINEAGE_START_RUN = WorkerStatement(
    "UPDATE jobs SET run_started_at = batchline_now() WHERE version = %(v)s AND run_started_at IS NULL "
    "RETURNING run_attempt", updates("jobs", "run_started_at"), *reads("jobs", "clock"))
LINEAGE_NEXT_ATTEMPT = "UPDATE jobs SET run_attempt = run_attempt + 1, run_started_at = NULL WHERE version = %(v)s"
LINEAGE_INSERT = WorkerStatement(
    "INSERT INTO lineage_outbox (version, kind, attempt, at, detail, dedupe, next_try_at) "
    "VALUES (%(v)s, %(kind)s, %(attempt)s, batchline_now(), %(detail)s, %(dedupe)s, batchline_now()) "
    "ON CONFLICT (dedupe) DO NOTHING", inserts("lineage_outbox"), *reads("lineage_outbox", "clock"))
LINEAGE_FIGURES = WorkerStatement(
    "SELECT COALESCE(sum(results_count), 0), COALESCE(sum(dead_count), 0), COALESCE(sum(carried), 0), "
    "COALESCE(sum(input_tokens), 0), COALESCE(sum(output_tokens), 0) FROM shards WHERE version = %(v)s",
    *reads("shards"))
LINEAGE_DEAD_BY_KIND = WorkerStatement(
    "SELECT kind, count(*) FROM dead_letters WHERE version = %(v)s GROUP BY kind", *reads("dead_letters"))
LINEAGE_PAID = WorkerStatement(
    "SELECT COALESCE(sum(COALESCE(stopped_at, batchline_now()) - started_at), 0), "
    "COALESCE(sum((COALESCE(stopped_at, batchline_now()) - started_at) * cost_per_hour / 3600.0), 0) "
    "FROM paid_workers WHERE version = %(v)s AND started_at IS NOT NULL", *reads("paid_workers", "clock"))
_OUTBOX_COLUMNS = "id, version, kind, attempt, at, detail, tries, sent_at, given_up_at, last_error"
_OUTBOX_DRAIN = updates("lineage_outbox", "claimed_by", "claimed_until", "tries", "sent_at", "last_error",
                        "next_try_at", "given_up_at")
LINEAGE_CLAIM = WorkerStatement(f"""
UPDATE lineage_outbox SET claimed_by = %(by)s, claimed_until = batchline_now() + %(hold)s, tries = tries + 1
WHERE id IN (SELECT id FROM lineage_outbox
             WHERE (%(v)s::text IS NULL OR version = %(v)s) AND sent_at IS NULL AND given_up_at IS NULL
               AND next_try_at <= batchline_now() AND (claimed_until IS NULL OR claimed_until < batchline_now())
             ORDER BY id LIMIT %(n)s FOR UPDATE SKIP LOCKED)
RETURNING {_OUTBOX_COLUMNS}""", _OUTBOX_DRAIN, *reads("lineage_outbox", "clock"))
LINEAGE_SENT = WorkerStatement(
    "UPDATE lineage_outbox SET sent_at = batchline_now(), claimed_until = NULL, last_error = NULL "
    "WHERE id = %(id)s AND claimed_by = %(by)s AND sent_at IS NULL", _OUTBOX_DRAIN, *reads("lineage_outbox", "clock"))
LINEAGE_FAILED = WorkerStatement(
    "UPDATE lineage_outbox SET last_error = %(error)s, claimed_until = NULL, "
    "next_try_at = batchline_now() + %(retry_in)s, "
    "given_up_at = CASE WHEN %(give_up)s THEN batchline_now() END "
    "WHERE id = %(id)s AND claimed_by = %(by)s AND sent_at IS NULL", _OUTBOX_DRAIN,
    *reads("lineage_outbox", "clock"))
# --- replicas and regions (batchline.store.replicas) -----------------------------------------

_REPLICA_COLUMNS = "region, location, root, pins, compared, by, added_at"
REPLICA_ADD = (f"INSERT INTO replicas (version, {_REPLICA_COLUMNS}) "
               "VALUES (%(v)s, %(region)s, %(location)s, %(root)s, %(pins)s, %(compared)s, %(by)s, batchline_now()) "
               "ON CONFLICT (version, region) DO UPDATE SET location = EXCLUDED.location, root = EXCLUDED.root, "
               "pins = EXCLUDED.pins, compared = EXCLUDED.compared, by = EXCLUDED.by, added_at = EXCLUDED.added_at")
REPLICAS = WorkerStatement(f"SELECT {_REPLICA_COLUMNS} FROM replicas WHERE version = %(v)s ORDER BY region",
                           *reads("replicas"))
SHARD_REGIONS = ("SELECT home, ran_in, state, count(*), sum(record_count) FROM shards WHERE version = %(v)s "
                 "GROUP BY home, ran_in, state ORDER BY home NULLS FIRST, ran_in NULLS FIRST, state")
WORKER_REGIONS = ("SELECT worker, region, cross_region_bytes FROM worker_beats WHERE version = %(v)s "
                  "ORDER BY worker")

LINEAGE_PARENT = WorkerStatement("SELECT lineage_parent FROM jobs WHERE version = %(v)s", *reads("jobs"))
SET_LINEAGE_PARENT = "UPDATE jobs SET lineage_parent = %(parent)s WHERE version = %(v)s"
LINEAGE_ROWS = (f"SELECT {_OUTBOX_COLUMNS} FROM lineage_outbox WHERE (%(v)s::text IS NULL OR version = %(v)s) "
                f"ORDER BY id")
LINEAGE_RETRY = ("UPDATE lineage_outbox SET given_up_at = NULL, tries = 0, next_try_at = batchline_now() "
                 "WHERE (%(v)s::text IS NULL OR version = %(v)s) AND sent_at IS NULL AND given_up_at IS NOT NULL")

# --- a version's outcomes by shard (batchline.store.files) -----------------------------------

SHARD_UNITS = ("SELECT shard_no, slice, first_piece, end_piece, record_count, carried, results_count, dead_count, "
               "files, epoch, ran_in FROM shards WHERE version = %(v)s ORDER BY shard_no")
_SHARD = "r.version = %(v)s AND r.shard_no = %(s)s"
RESULTS_OF_SHARD = f"SELECT {_RESULT_COLUMNS} {_RESULTS_FROM} WHERE {_SHARD} ORDER BY r.record_id"
RESULTS_OF_SHARD_CARRY = f"SELECT {_RESULT_COLUMNS}, c.carry {_RESULTS_FROM} {_CARRY_FROM} WHERE {_SHARD} ORDER BY r.record_id"
# What a worker writes of its shard: the outcomes it may read (its version's rows; a carried
# result's payload is another version's, which its role does not see).
# (No carried result, so no row of another version to join.)
_COMPUTED_FROM = "FROM results r " + _PLANNED_ACL.format(t="r")
_COMPUTED_COLUMNS = _RESULT_COLUMNS.replace("COALESCE(r.output, o.output)", "r.output").replace(
    "o.worker, o.epoch", "NULL, NULL::bigint")
COMPUTED_RESULTS_OF_SHARD = WorkerStatement(
    f"SELECT {_COMPUTED_COLUMNS} {_COMPUTED_FROM} WHERE {_SHARD} AND r.origin IS NULL ORDER BY r.record_id",
    *reads("results", "records", "acls"))
COMPUTED_RESULTS_OF_SHARD_CARRY = WorkerStatement(
    f"SELECT {_COMPUTED_COLUMNS}, c.carry {_COMPUTED_FROM} {_CARRY_FROM} WHERE {_SHARD} AND r.origin IS NULL "
    f"ORDER BY r.record_id", *reads("results", "records", "acls"))
# What a shard's worker computed, the columns its file holds alone (ShardOutcomes.shard_columns),
# each with its record's planned ACL read from the records of the shard's current slice (found by
# piece: one hash join, where a probe of the records' key per row took twice as long). The outcome
# fence refuses an outcome of a record outside the slice; one there anyway reads no ACL, which the
# shard-file check refuses. A shard planned without pieces reads each record by its id.
# No JIT for the rest of the read: compiling a shard's few thousand rows' plan (which a planner
# estimate can price past jit_above_cost) took longer than reading them.
SHARD_PIECES = ("SELECT first_piece, end_piece, set_config('jit', 'off', true) FROM shards "
                "WHERE version = %(v)s AND shard_no = %(s)s")
SHARD_COLUMNS = (f"SELECT r.record_id, r.output, pacl.acl, r.label, r.model, r.attempt, r.input_tokens, "
                 f"r.output_tokens, r.created_at FROM results r "
                 f"LEFT JOIN records pr ON pr.version = r.version AND pr.record_id = r.record_id "
                 f"AND (%(first)s::int IS NULL OR (pr.piece >= %(first)s AND pr.piece < %(end)s)) "
                 f"LEFT JOIN acls pacl ON pacl.version = pr.version AND pacl.acl_no = pr.acl_no "
                 f"WHERE {_SHARD} AND r.origin IS NULL ORDER BY r.record_id")
DEAD_LETTERS_OF_SHARD = WorkerStatement(
    f"SELECT {_DEAD_COLUMNS} {_DEAD_FROM} WHERE d.version = %(v)s AND d.shard_no = %(s)s ORDER BY d.record_id",
    *reads("dead_letters", "records", "acls"))
DEAD_LETTERS_OF_SHARD_CARRY = WorkerStatement(
    f"SELECT {_DEAD_COLUMNS}, c.carry {_DEAD_FROM} LEFT JOIN records c "
    f"ON c.version = %(v)s AND c.record_id = d.record_id "
    f"WHERE d.version = %(v)s AND d.shard_no = %(s)s ORDER BY d.record_id",
    *reads("dead_letters", "records", "acls"))

