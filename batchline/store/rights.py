"""A worker's rights, said once (I8).

A worker runs beside untrusted text on shared or preemptible nodes, so what its
credentials allow is what a compromised worker can do. Everything it may do is
said here, and each backend derives its enforcement from these lines:

- **Tables and privileges** are the union of what the statements a worker runs
  declare (`postgres_sql.WorkerStatement`); PostgreSQL's role (`batchline grants`)
  gets exactly that, kept to its version's rows by row-level security.
  `POLICY_OVERRIDES` says where a policy admits less than those rows.
- **Shards** change only as a worker's fenced statements change them
  (`SHARD_RULES`): a claim, a renewal, a release, a park at a provider, a split,
  a take-back, a completion. A leased shard is changed at its epoch only by the
  lease's holder, who proves it with the lease's key: a random secret the
  claimer made, of which the store keeps only the SHA-256 (`lease_key`), so
  another worker of the same role, who can read the shard's row, cannot act for
  it. PostgreSQL holds every role but the owner to these rules in a trigger;
  SQLite has no roles, and its worker statements carry the same lease
  predicate (`HELD`).
- **Outcomes** (a result, a dead letter) are inserted only under `OUTCOME_RULES`:
  the version open, the shard leased to the writer at that epoch, by the lease's
  key, and the record planned in that shard's current slice. PostgreSQL checks
  every statement of every role but the owner in a statement trigger (one
  set-based query over the rows it added); SQLite runs the same rules as a
  query in the put's own transaction before it writes.
- **Who reads a result** is never a worker's to say: a result's ACL is its
  record's as the planner read it (`acls`, `records.acl_no`), and every reader
  reads it from there. What a worker puts in a result's `acl` column is kept as
  what it claimed, and read by no one.
- **Times** of a paid start are the database's (`PAID_TIMES`).

A rule is a SQL predicate in the dialect both stores share (no `IS DISTINCT
FROM` in the outcome rules, which SQLite runs too), with `{key}` standing for
the SHA-256 of the key the writer presented; each backend says what that is.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

# Row-level security admits a worker role to its version's rows (or, for a role made for a job's
# name, every version of it). Where a command needs less than `{mine}` (those rows), it is said
# here: sealing and halting are the changes a worker makes to its job (from ready to sealed, or
# to halted when its dead letters pass their bound), and a worker cannot forge a carried result.
POLICY_OVERRIDES: dict[tuple[str, str], tuple[str | None, str | None]] = {
    ("jobs", "UPDATE"): ("{mine} AND state = 'ready'", "{mine} AND state IN ('ready', 'sealed', 'halted')"),
    ("results", "INSERT"): (None, "{mine} AND origin IS NULL"),
}


@dataclass(frozen=True)
class Rule:
    """`sql`: the predicate; `why`: the refusal's words when it fails (or, for a shard rule,
    when it holds: see `SHARD_RULES`)."""

    sql: str
    why: str


# A lease's key: made by the claimer, presented with each write under the lease, never stored.
def new_lease_key() -> str:
    return secrets.token_hex(32)


def key_hash(key: str) -> str:
    """What the store keeps of a lease's key, and compares a presented key's hash with."""
    return hashlib.sha256(key.encode()).hexdigest()


# The columns a holder's statements change at its epoch; a split changes a shard's end,
# its record count and its planner-dead count only, and is any worker's to make.
_HOLDER_COLUMNS = ("state", "lease_expires", "files", "results_count", "input_tokens", "output_tokens",
                   "started_piece", "batch", "poll_at", "done_at", "lease_key")


def _changed(columns: tuple[str, ...]) -> str:
    new = ", ".join(f"NEW.{c}" for c in columns)
    old = ", ".join(f"OLD.{c}" for c in columns)
    return f"ROW({new}) IS DISTINCT FROM ROW({old})"


# A worker's change to a shard, refused by the first rule whose predicate holds (each test
# is a violation unless it is known to hold: an unknown, NULL, is refused). In PostgreSQL's
# dialect, over OLD and NEW: only a trigger sees both.
SHARD_INSERT_RULE = Rule(
    "NEW.state <> 'ready' OR NEW.owner IS NOT NULL OR NEW.epoch <> 0 OR NEW.files IS NOT NULL "
    "OR NEW.results_count <> 0 OR NEW.carried <> 0 OR NEW.batch IS NOT NULL OR NEW.claims <> 0 "
    "OR NEW.lease_key IS NOT NULL",
    "a new shard is a split's: ready, nobody's, nothing done of it")
SHARD_RULES: tuple[Rule, ...] = (
    Rule("NEW.version <> OLD.version OR NEW.shard_no <> OLD.shard_no OR NEW.slice IS DISTINCT FROM OLD.slice "
         "OR NEW.route IS DISTINCT FROM OLD.route OR NEW.first_piece IS DISTINCT FROM OLD.first_piece "
         "OR NEW.carried <> OLD.carried OR NEW.home IS DISTINCT FROM OLD.home",
         "a shard's version, number, slice, route, home and carried results are the planner's"),
    Rule("OLD.state = 'done'", "a completed shard is not changed by a worker"),
    Rule("NEW.files IS DISTINCT FROM OLD.files AND NOT COALESCE(OLD.state = 'leased' AND NEW.state = 'done' "
         "AND NEW.epoch = OLD.epoch AND NEW.owner IS NOT DISTINCT FROM OLD.owner, false)",
         "a shard's file is recorded only by the completion of its current lease"),
    Rule("NEW.state = 'done' AND NOT COALESCE(OLD.state = 'leased' AND NEW.epoch = OLD.epoch "
         "AND NEW.results_count + NEW.dead_count = NEW.record_count, false)",
         "a shard is completed only by its current lease, once every record has an outcome"),
    Rule("NEW.epoch < OLD.epoch OR NEW.epoch > OLD.epoch + 1",
         "an epoch only moves up by one, with a claim or a take-back"),
    Rule("NEW.epoch = OLD.epoch + 1 AND NOT COALESCE("
         "(NEW.state = 'leased' AND (OLD.state = 'ready' OR (OLD.state = 'leased' AND OLD.lease_expires <= {now}) "
         "OR (OLD.state = 'submitted' AND OLD.poll_at <= {now}))) "
         "OR (OLD.state = 'leased' AND NEW.state IN ('ready', 'submitted') AND NEW.owner IS NULL), false)",
         "a new epoch is a claim of a claimable shard or the take-back of a lease"),
    Rule("NEW.epoch = OLD.epoch AND NEW.ran_in IS DISTINCT FROM OLD.ran_in",
         "where a shard runs is set only by a claim"),
    Rule("NEW.epoch = OLD.epoch AND NEW.owner IS DISTINCT FROM OLD.owner AND NEW.owner IS NOT NULL",
         "a lease changes hands only with a new epoch"),
    Rule("NEW.results_count < OLD.results_count OR NEW.input_tokens < OLD.input_tokens "
         "OR NEW.output_tokens < OLD.output_tokens OR NEW.claims < OLD.claims",
         "a shard's counts of outcomes, tokens and claims never go down"),
    Rule("(NEW.record_count <> OLD.record_count OR NEW.dead_count < OLD.dead_count "
         "OR NEW.end_piece IS DISTINCT FROM OLD.end_piece) "
         "AND NOT COALESCE(OLD.state = 'leased' AND NEW.end_piece < OLD.end_piece "
         "AND NEW.record_count < OLD.record_count AND NEW.record_count >= 0, false)",
         "a shard's records shrink only when a split moves its tail"),
    Rule("NEW.epoch = OLD.epoch AND NEW.lease_key IS DISTINCT FROM OLD.lease_key",
         "a lease's key is set only by the claim that makes it"),
    Rule(f"NEW.epoch = OLD.epoch AND OLD.state = 'leased' AND {_changed(_HOLDER_COLUMNS)} "
         "AND NOT COALESCE(OLD.lease_key = {key}, false)",
         "a leased shard is changed at its epoch only by the lease's holder (its key), or split"),
)

# An outcome `n` (a result or a dead letter) a worker adds, refused by the first rule that does
# not hold. The lease rules read its version, shard, worker and epoch (`n`), its shard `s` and its
# job `j`, once for each lease a statement writes under; the record rules read its planned record
# `p` and its shard's current slice (`s`), once for each row. (Each is joined on the outcome's
# version, shard and record, so a missing one is NULL and fails its rule.)
# Said by the fences and by a completion whose owner and epoch are current but not its key.
NOT_THE_HOLDER = "the writer does not hold the shard's lease (its key)"
LEASE_RULES: tuple[Rule, ...] = (
    Rule("j.state = 'ready'", "its version is not open (sealed, halted or cancelled)"),
    Rule("s.state = 'leased' AND s.owner = n.worker AND s.epoch = n.epoch",
         "its shard is not leased to that worker at that epoch"),
    Rule("s.lease_key = {key}", NOT_THE_HOLDER),
)
RECORD_RULES: tuple[Rule, ...] = (
    Rule("p.record_id IS NOT NULL", "its record is not one this version planned"),
    # A record's piece is kept at planning, so a split's new shard covers it by range; a record
    # of a version planned before pieces were kept belongs to the shard it was planned in.
    Rule("CASE WHEN p.piece IS NOT NULL AND s.first_piece IS NOT NULL "
         "THEN p.piece >= s.first_piece AND p.piece < s.end_piece "
         "ELSE p.shard_no = s.shard_no OR (p.piece IS NULL AND s.first_piece IS NOT NULL) END",
         "its record is not in the shard's current slice"),
)
OUTCOME_RULES = LEASE_RULES + RECORD_RULES


def first_refusal(rules: tuple[Rule, ...], *, key: str, now: str = "") -> str:
    """A SQL expression: the `why` of the first rule of `rules` that does not hold (NULL when
    all hold), with `{key}` and `{now}` as the backend says them."""
    cases = " ".join(
        f"WHEN NOT COALESCE({rule.sql.format(key=key, now=now)}, false) THEN '{_quoted(rule.why)}'"
        for rule in rules)
    return f"CASE {cases} END"


def _quoted(text: str) -> str:
    return text.replace("'", "''")


# A paid start's times are the database's: whatever an UPDATE sets them to, its first heartbeat's
# time is kept as started_at, each heartbeat's as seen_at, its first claim's as claimed_at, and its
# stop's as stopped_at (set once); its launch and price never change. The spend max_cost is held
# against is computed from them, so a worker, which may update its own start's heartbeat and stop,
# cannot make the spend look smaller. (PostgreSQL's dialect; `{now}` is its clock.)
PAID_TIMES: tuple[tuple[str, str], ...] = (
    ("launched_at", "OLD.launched_at"),
    ("cost_per_hour", "OLD.cost_per_hour"),
    ("seen_at", "CASE WHEN NEW.seen_at IS DISTINCT FROM OLD.seen_at THEN {now} ELSE OLD.seen_at END"),
    ("started_at", "COALESCE(OLD.started_at, CASE WHEN NEW.seen_at IS NOT NULL THEN NEW.seen_at END)"),
    ("claimed_at", "COALESCE(OLD.claimed_at, CASE WHEN NEW.claimed_at IS NOT NULL THEN {now} END)"),
    ("stopped_at", "COALESCE(OLD.stopped_at, CASE WHEN NEW.stopped_at IS NOT NULL THEN {now} END)"),
)
