"""A discrete-event simulation of a batch job on preemptible workers.

What it is for: choosing a shard size and a write strategy, and sizing the
allowance for interruptions, before a job runs (``batchline simulate``,
``batchline capacity``, and ``shards.size: auto`` in a job spec).

The model
---------
``workers`` slots each run one worker at ``records_per_second``. Each slot is
interrupted at exponential intervals (``interruptions_per_hour``); an
interruption is either

- a *death* (a spot reclaim, a lost machine): the worker is gone, and a
  replacement starts at once and spends ``model_load_seconds`` loading the
  model. Without a preemption notice the dead worker's shard stays leased until
  its lease runs out; with one (``notice``) the worker writes what it has
  finished and gives the lease back at once, as batchline's worker does (I5);
- a *stall* (a frozen VM, a long pause, a partition): the worker comes back
  after its lease has expired, ``lease_seconds`` plus an exponential
  ``stall_extra_seconds`` later, and still tries to write what it computed.
  The default extra is 0: the shortest absence that loses the lease, since a
  shorter pause costs only itself.

The interruption clock runs whatever the slot is doing: a loading or stalled
machine can be reclaimed too (a death ends a stall; a stall while stalled is
no event). A silent owner's lease runs out ``lease_seconds`` after its last
renewal, which came every ``renew_seconds`` while it worked. With a notice, a
whole-shard writer finishes its shard if that takes less than
``grace_seconds`` and otherwise drops it; a per-record writer writes every
record it has finished, the part of a write batch included.

Every claim of a shard costs ``shard_overhead_seconds`` (the claim, reading and
checking the slice, the final write). Three write strategies:

- ``append-per-shard``: the worker appends a shard's rows when it ends. Nothing
  is durable until then, nothing is fenced, so a stalled worker that comes back
  appends the rows it had: duplicates, on every stall.
- ``keyed-per-shard``: the shard's rows are written at its end under keys and
  the writer's lease epoch. No duplicates; any interruption loses the shard's
  whole progress.
- ``keyed-per-record``: each record is written under its key as soon as it
  exists (in write batches of ``write_batch``), so an interruption loses only
  the records in flight, and whoever re-claims the shard skips what is there.

Two things end a lease sooner, as the store does them and by the store's own rules:

- ``take_back``: a dead worker's lease is taken back ``take_back_seconds``
  after its death (another worker on its host, the runner or the launcher
  proves it dead: its pid gone, its pod gone, its actor dead), instead of
  running out. A stalled worker is alive and is never taken for dead; nor is
  anyone on a silence alone: a lease whose owner cannot be proven dead runs out.
- ``tail_split``: with no ready shard left, an idle worker splits the leased
  shard with the most unstarted pieces (each shard is planned as
  ``pieces_per_shard`` pieces): its owner keeps the nearer half of what it has
  not started and the rest becomes a new shard (`batchline.store.core.split_point`,
  the rule the store applies). An owner has started a piece once it has sent a
  record of it to its engine (it keeps ``2 x write_batch`` records in flight),
  or once a record of it is written. A stalled or silent owner's unstarted
  pieces are split off as well: its lease still stands.

Correlated reclaim waves (``waves_per_hour``) kill ``wave_share`` of the slots
at once, as when a zone runs short; their replacements wait a further
``wave_recovery_seconds`` for capacity.

What is measured
----------------
Makespan (until every record is durably written), the ideal
(items / (workers x rate) plus one model load), GPU-hours lost
(workers x (makespan - ideal), broken down into reloads, stalls, per-shard
overhead, recomputed work and idle time) and duplicate rows. Every write is
logged as a range of record numbers, so duplicates and coverage are counted
from what was written, not assumed from the strategy.

Determinism: a run is a pure function of its inputs and seed. Each slot draws
its interruptions from its own stream (seeded by the seed and the slot), which
does not depend on the strategy or shard size, so every strategy and size sees
the same interruptions for the same seed (common random numbers: comparisons
between them are not drowned in seed noise).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from batchline.snapshot import PIECES_PER_SHARD
from batchline.spec import ShardSpec
from batchline.store.core import split_point

# The lease, renewal, grace and batch of a scenario are the spec's shard defaults unless it
# says otherwise, so the two cannot drift apart.
_SHARDS = ShardSpec()


class Strategy(StrEnum):
    APPEND_PER_SHARD = "append-per-shard"
    KEYED_PER_SHARD = "keyed-per-shard"
    KEYED_PER_RECORD = "keyed-per-record"


@dataclass(frozen=True)
class Scenario:
    items: int
    workers: int
    records_per_second: float  # per worker
    interruptions_per_hour: float  # per worker
    stall_share: float = 0.2
    model_load_seconds: float = 180.0
    lease_seconds: float = _SHARDS.lease_seconds
    shard_overhead_seconds: float = 3.0
    # A stall lasts lease_seconds (the shortest absence that loses the lease:
    # the worker comes back just after its lease expired) plus an exponential
    # extra with this mean. Shorter pauses are not stalls in this sense: the
    # worker renews in time and loses only the pause.
    stall_extra_seconds: float = 0.0
    # Records a worker writes at a time under keyed-per-record: an interruption
    # without notice loses the batch in flight. The worker's default batch.
    write_batch: int = _SHARDS.batch_size
    renew_seconds: float = _SHARDS.renew_seconds
    # A worker with a preemption notice may finish a shard this close to its end.
    grace_seconds: float = _SHARDS.grace_seconds
    notice: bool = False
    # Off here although ShardSpec turns it on: the seed design's reference table (and the
    # simulator's reference figures) are reproduced without tail splitting.
    tail_split: bool = False
    pieces_per_shard: int = PIECES_PER_SHARD
    take_back: bool = False
    take_back_seconds: float = 5.0
    waves_per_hour: float = 0.0
    wave_share: float = 0.5
    wave_recovery_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("items", "workers", "records_per_second", "model_load_seconds",
                     "lease_seconds", "write_batch", "renew_seconds", "pieces_per_shard"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', ' ')} must be positive")
        for name in ("interruptions_per_hour", "shard_overhead_seconds", "stall_extra_seconds",
                     "grace_seconds", "waves_per_hour", "wave_recovery_seconds", "take_back_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name.replace('_', ' ')} cannot be negative")
        for name in ("stall_share", "wave_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name.replace('_', ' ')} must be between 0 and 1")

    @property
    def ideal_seconds(self) -> float:
        return self.items / (self.workers * self.records_per_second) + self.model_load_seconds


@dataclass(frozen=True)
class LostTime:
    """Worker-seconds beyond the ideal, by cause; they add up to workers x (makespan - ideal)."""

    reload: float  # model loads beyond the first per slot, and waits for capacity after a wave
    stall: float
    overhead: float  # per-shard overhead
    redone: float  # computed but lost (or written twice)
    idle: float  # no work to take: waiting on leases, and the tail

    @property
    def total(self) -> float:
        return self.reload + self.stall + self.overhead + self.redone + self.idle


@dataclass(frozen=True)
class RunResult:
    scenario: Scenario
    strategy: Strategy
    shard_size: int
    seed: int
    makespan_seconds: float
    duplicate_rows: int
    missing_rows: int
    deaths: int
    stalls: int
    waves: int
    splits: int
    take_backs: int
    lost: LostTime

    @property
    def ideal_seconds(self) -> float:
        return self.scenario.ideal_seconds

    @property
    def over_ideal(self) -> float:
        return self.makespan_seconds / self.scenario.ideal_seconds

    @property
    def gpu_hours_lost(self) -> float:
        return self.scenario.workers * (self.makespan_seconds - self.scenario.ideal_seconds) / 3600.0


@dataclass(frozen=True)
class SweepRow:
    """One strategy and shard size, averaged over seeds."""

    strategy: Strategy
    shard_size: int
    seeds: int
    makespan_hours: float
    makespan_hours_stdev: float
    over_ideal: float
    gpu_hours_lost: float
    duplicate_rows: float
    lost_hours: dict[str, float] = field(default_factory=dict)
    makespans_hours: tuple[float, ...] = ()  # each seed's run

    def runs_within(self, deadline_hours: float) -> int:
        """How many of its runs (one per seed) ended by the deadline."""
        return sum(hours <= deadline_hours for hours in self.makespans_hours)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["strategy"] = str(self.strategy)
        return out


# --- the simulation ------------------------------------------------------------

_LOADING, _WORKING, _IDLE, _STALLED = range(4)
_READY, _LEASED, _DONE = range(3)
# Event kinds, in the order ties at one instant are served: work that completes
# at the same moment as an interruption counts as done.
_RUN_DONE, _LOAD_DONE, _STALL_END, _LEASE_EXPIRE, _INTERRUPT, _WAVE = range(6)


class _Shard:
    __slots__ = ("done", "epoch", "hi", "lo", "origin", "owner", "piece", "sent", "silent_since", "state")

    def __init__(self, lo: int, hi: int, origin: int, piece: int) -> None:
        self.lo = lo
        self.done = lo  # records [lo, done) are durably written
        self.hi = hi
        self.origin = origin  # where the planned shard began: pieces are counted from it
        self.piece = piece  # records per piece
        self.sent = lo  # records before it were sent to an engine (started) by some owner
        self.state = _READY
        self.owner = -1
        self.epoch = 0
        self.silent_since: float | None = None  # its owner's last renewal, once it has stopped

    def piece_of(self, record: int) -> int:
        return (record - self.origin) // self.piece


class _Worker:
    __slots__ = ("claim_time", "compute_start", "draining", "gen", "idx", "load_end", "load_left", "pending",
                 "resume_loading", "run_start", "shard", "since", "state")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.state = _LOADING
        self.gen = 0  # bumped to cancel this worker's scheduled events
        self.since = 0.0  # when the current state began, for the accounting
        self.shard: _Shard | None = None
        self.run_start = 0  # record number this run of work started at
        self.claim_time = 0.0
        self.compute_start = 0.0  # claim time + per-shard overhead
        self.draining = False  # dying after a notice, finishing its shard within the grace
        self.pending: tuple[int, int] | None = None  # rows a stalled appender still holds
        self.resume_loading = False
        self.load_left = 0.0
        self.load_end = 0.0


class _Sim:
    def __init__(self, sc: Scenario, strategy: Strategy, shard_size: int, seed: int) -> None:
        if shard_size < 1:
            raise ValueError("shard size must be at least 1")
        self.sc = sc
        self.strategy = strategy
        self.per_record = strategy is Strategy.KEYED_PER_RECORD
        self.rate = sc.records_per_second
        self.overhead = sc.shard_overhead_seconds
        self.lookahead = 2 * sc.write_batch  # records a worker keeps in flight at its engine
        piece = max(1, math.ceil(shard_size / sc.pieces_per_shard))
        self.shards: deque[_Shard] = deque(
            _Shard(lo, min(lo + shard_size, sc.items), lo, piece) for lo in range(0, sc.items, shard_size)
        )
        self.open = len(self.shards)
        self.leased: dict[int, _Shard] = {}  # id(shard) -> shard, for the tail
        self.idle: set[int] = set()
        self.workers = [_Worker(i) for i in range(sc.workers)]
        self.writes: list[tuple[int, int]] = []
        self.events: list[tuple[float, int, int, int, int, Any]] = []
        self.seq = 0
        self.finished_at: float | None = None
        self.deaths = self.stalls = self.waves = self.splits = self.take_backs = 0
        # Worker-seconds by what the slot was doing.
        self.load_time = self.stall_time = self.overhead_time = 0.0
        self.compute_time = self.idle_time = 0.0
        self.slot_rngs = [random.Random(f"batchline-sim/{seed}/slot/{i}") for i in range(sc.workers)]
        self.wave_rng = random.Random(f"batchline-sim/{seed}/waves")

    # -- scheduling

    def push(self, at: float, kind: int, a: int, b: int, extra: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, kind, self.seq, a, b, extra))

    def next_interrupt(self, slot: int, now: float) -> None:
        rate = self.sc.interruptions_per_hour / 3600.0
        if rate <= 0:
            return
        rng = self.slot_rngs[slot]
        # Draw all three numbers every time so that a slot's stream of
        # interruptions is the same whatever the kinds turn out to be.
        gap = rng.expovariate(rate)
        is_stall = rng.random() < self.sc.stall_share
        extra = -math.log(1.0 - rng.random()) * self.sc.stall_extra_seconds  # exponential
        self.push(now + gap, _INTERRUPT, slot, 0, (is_stall, self.sc.lease_seconds + extra))

    def next_wave(self, now: float) -> None:
        rate = self.sc.waves_per_hour / 3600.0
        if rate > 0:
            self.push(now + self.wave_rng.expovariate(rate), _WAVE, -1, 0)

    # -- accounting

    def book(self, w: _Worker, t: float) -> None:
        """Charge the time since w.since to what w was doing, and restart the clock."""
        span = t - w.since
        if w.state == _WORKING:
            over = min(span, max(0.0, w.compute_start - w.since))
            self.overhead_time += over
            self.compute_time += span - over
        elif w.state == _LOADING:
            self.load_time += span
        elif w.state == _STALLED:
            self.stall_time += span
        else:
            self.idle_time += span
        w.since = t

    # -- workers

    def position(self, w: _Worker, t: float) -> float:
        assert w.shard is not None
        return min(float(w.shard.hi), w.run_start + max(0.0, t - w.compute_start) * self.rate)

    def durable_without_notice(self, w: _Worker, pos: float) -> int:
        # The write batch in flight is lost; what completed before it was written.
        b = self.sc.write_batch
        return w.run_start + int((pos - w.run_start) // b) * b

    def start_load(self, w: _Worker, t: float, seconds: float) -> None:
        w.state, w.since, w.gen = _LOADING, t, w.gen + 1
        w.shard, w.draining, w.pending = None, False, None
        self.idle.discard(w.idx)
        w.load_end = t + seconds
        self.push(w.load_end, _LOAD_DONE, w.idx, w.gen)

    def assign(self, w: _Worker, s: _Shard, t: float) -> None:
        s.state, s.owner, s.epoch, s.silent_since = _LEASED, w.idx, s.epoch + 1, None
        self.leased[id(s)] = s
        if not self.per_record:
            s.done = s.lo  # nothing of it is durable until it ends: the run starts over
        w.state, w.since, w.gen = _WORKING, t, w.gen + 1
        w.shard, w.run_start, w.claim_time = s, s.done, t
        w.compute_start = t + self.overhead
        self.idle.discard(w.idx)
        self.push(w.compute_start + (s.hi - w.run_start) / self.rate, _RUN_DONE, w.idx, w.gen)

    def claim(self, w: _Worker, t: float) -> None:
        while self.shards:
            s = self.shards.popleft()
            if s.state == _READY:
                self.assign(w, s, t)
                return
        if self.sc.tail_split and self.help_at_tail(w, t):
            return
        w.state, w.since, w.gen = _IDLE, t, w.gen + 1
        w.shard = None
        self.idle.add(w.idx)

    def complete(self, w: _Worker, s: _Shard, t: float) -> None:
        self.writes.append((w.run_start, s.hi))
        s.done, s.state = s.hi, _DONE
        del self.leased[id(s)]
        w.shard = None
        self.open -= 1
        if self.open == 0:
            self.finished_at = t

    def release(self, s: _Shard, t: float) -> None:
        """The shard is ready again; the epoch bump fences out whoever held it."""
        s.state, s.owner, s.epoch, s.silent_since = _READY, -1, s.epoch + 1, None
        self.leased.pop(id(s), None)
        self.shards.appendleft(s)  # re-claims pick the lowest shard number: it comes first
        self.wake(t)

    def go_silent(self, w: _Worker, s: _Shard, t: float, *, dead: bool) -> None:
        """w stops renewing s: the lease runs out lease_seconds after its last renewal,
        unless w died and is proven dead sooner (take_back)."""
        renew = self.sc.renew_seconds
        s.sent = max(s.sent, self.sent_position(w, t))
        s.silent_since = w.claim_time + math.floor((t - w.claim_time) / renew) * renew
        ends = s.silent_since + self.sc.lease_seconds
        if dead and self.sc.take_back and t + self.sc.take_back_seconds < ends:
            ends = t + self.sc.take_back_seconds
            self.take_backs += 1
        self.push(ends, _LEASE_EXPIRE, id(s), s.epoch, s)

    def wake(self, t: float) -> None:
        for idx in sorted(self.idle):
            if not self.shards and not self.sc.tail_split:
                break
            w = self.workers[idx]
            self.book(w, t)
            self.claim(w, t)

    # -- the tail

    def sent_position(self, w: _Worker, t: float) -> int:
        """Records before it have been sent to w's engine: w has started their pieces."""
        if w.shard is None or t < w.compute_start:
            return w.run_start
        return min(w.shard.hi, math.floor(self.position(w, t)) + self.lookahead)

    def help_at_tail(self, w: _Worker, t: float) -> bool:
        """Split off the unstarted tail of the leased shard that has the most of it, by the
        store's rule (`split_point`), and claim it."""
        best: tuple[int, _Shard, int] | None = None  # (unstarted pieces, shard, split point in records)
        for s in self.leased.values():
            owner = self.workers[s.owner] if s.owner >= 0 else None
            if owner is not None and owner.draining:
                continue
            sent = s.sent
            if owner is not None and owner.shard is s:
                sent = max(sent, self.sent_position(owner, t))
            started = s.piece_of(max(sent, s.done) - 1) + 1 if max(sent, s.done) > s.lo else s.piece_of(s.lo)
            first, end = s.piece_of(s.lo), -(-(s.hi - s.origin) // s.piece)
            point = split_point(first, end, started)
            if point is None:
                continue
            unstarted = end - max(started, first)
            if best is None or unstarted > best[0]:
                best = (unstarted, s, min(s.hi, s.origin + point * s.piece))
        if best is None:
            return False
        _, s, mid = best
        # The owner keeps [.., mid) and its lease; the tail becomes a ready shard of its
        # own, which this worker claims.
        self.splits += 1
        tail = _Shard(mid, s.hi, s.origin, s.piece)
        s.hi = mid
        owner = self.workers[s.owner] if s.owner >= 0 else None
        if owner is not None and owner.shard is s and owner.state == _WORKING and not owner.draining:
            owner.gen += 1
            self.push(owner.compute_start + (mid - owner.run_start) / self.rate, _RUN_DONE, owner.idx, owner.gen)
        self.open += 1
        self.assign(w, tail, t)
        return True

    # -- events

    def on_interrupt(self, w: _Worker, t: float, is_stall: bool, stall_seconds: float) -> None:
        self.next_interrupt(w.idx, t)
        if w.draining:
            return  # already going away after a notice
        if is_stall:
            self.stall(w, t, stall_seconds)
        else:
            self.die(w, t, notice=self.sc.notice, delay=0.0)

    def die(self, w: _Worker, t: float, *, notice: bool, delay: float) -> None:
        if w.draining:
            return
        self.deaths += 1
        self.book(w, t)
        if w.state == _WORKING:
            s = w.shard
            assert s is not None
            pos = self.position(w, t)
            if notice and self.per_record:
                # Stop intake and flush within the grace: the partial write batch
                # is saved too, only the record being computed is lost.
                durable = math.floor(pos)
                if durable >= s.hi:
                    self.complete(w, s, t)
                else:
                    self.writes.append((w.run_start, durable))
                    s.done = durable
                    self.release(s, t)
            elif notice:
                if (s.hi - pos) / self.rate + max(0.0, w.compute_start - t) <= self.sc.grace_seconds:
                    w.draining = True  # its RUN_DONE stands; the replacement starts after it
                    return
                self.release(s, t)  # rows held in memory are dropped, never half-written
            else:
                if self.per_record:
                    durable = self.durable_without_notice(w, pos)
                    if durable >= s.hi:
                        self.complete(w, s, t)
                        self.start_load(w, t, self.sc.model_load_seconds + delay)
                        return
                    self.writes.append((w.run_start, durable))
                    s.done = durable
                self.go_silent(w, s, t, dead=True)
        self.start_load(w, t, self.sc.model_load_seconds + delay)

    def stall(self, w: _Worker, t: float, seconds: float) -> None:
        if w.state == _STALLED:
            return
        self.stalls += 1
        self.book(w, t)
        resume_loading = False
        if w.state == _WORKING:
            s = w.shard
            assert s is not None
            pos = self.position(w, t)
            if self.per_record:
                durable = self.durable_without_notice(w, pos)
                self.writes.append((w.run_start, durable))
                s.done = durable
            elif self.strategy is Strategy.APPEND_PER_SHARD:
                w.pending = (w.run_start, math.floor(pos))
            self.go_silent(w, s, t, dead=False)
            w.shard = None
        elif w.state == _LOADING:
            resume_loading = True
            w.load_left = w.load_end - t
        elif w.state == _IDLE:
            self.idle.discard(w.idx)
        w.state, w.since, w.gen = _STALLED, t, w.gen + 1
        w.resume_loading = resume_loading
        self.push(t + seconds, _STALL_END, w.idx, w.gen)

    def on_stall_end(self, w: _Worker, t: float) -> None:
        self.book(w, t)
        if w.pending is not None:
            # Unfenced, the appender writes what it held; the shard was re-claimed
            # when the lease expired, so these rows are there twice.
            lo, hi = w.pending
            if hi > lo:
                self.writes.append((lo, hi))
            w.pending = None
        if w.resume_loading:
            w.resume_loading = False
            w.state, w.since, w.gen = _LOADING, t, w.gen + 1
            w.load_end = t + w.load_left
            self.push(w.load_end, _LOAD_DONE, w.idx, w.gen)
        else:
            self.claim(w, t)

    def on_wave(self, t: float) -> None:
        self.waves += 1
        self.next_wave(t)
        count = round(self.sc.wave_share * self.sc.workers)
        for idx in sorted(self.wave_rng.sample(range(self.sc.workers), count)):
            w = self.workers[idx]
            self.die(w, t, notice=self.sc.notice, delay=self.sc.wave_recovery_seconds)
            if self.finished_at is not None:
                return

    def start(self) -> None:
        """Every slot loads its model at time 0 and has its interruptions drawn."""
        for w in self.workers:
            w.load_end = self.sc.model_load_seconds
            self.push(w.load_end, _LOAD_DONE, w.idx, w.gen)
            self.next_interrupt(w.idx, 0.0)
        self.next_wave(0.0)

    def on_other(self, kind: int, t: float, a: int, b: int, extra: Any) -> None:
        """An event of a kind a variant of the simulation adds (batchline.sizing.paced)."""
        raise AssertionError(f"no handler for event kind {kind}")

    def run(self, max_seconds: float) -> None:
        self.start()
        while self.finished_at is None:
            if not self.events:
                raise AssertionError("simulation stalled with work left and nothing scheduled")
            t, kind, _, a, b, extra = heapq.heappop(self.events)
            if t > max_seconds:
                raise SimulationDiverged(
                    f"the job did not finish within {max_seconds / 3600:.0f} hours of simulated time; "
                    "interruptions outpace the work"
                )
            if kind == _RUN_DONE:
                w = self.workers[a]
                if b != w.gen:
                    continue
                s = w.shard
                assert s is not None
                self.book(w, t)
                self.complete(w, s, t)
                if w.draining:
                    self.start_load(w, t, self.sc.model_load_seconds)
                elif self.finished_at is None:
                    self.claim(w, t)
            elif kind == _LOAD_DONE:
                w = self.workers[a]
                if b != w.gen:
                    continue
                self.book(w, t)
                self.claim(w, t)
            elif kind == _STALL_END:
                w = self.workers[a]
                if b != w.gen:
                    continue
                self.on_stall_end(w, t)
            elif kind == _LEASE_EXPIRE:
                s = extra
                if s.epoch == b and s.state == _LEASED:
                    self.release(s, t)
            elif kind == _INTERRUPT:
                is_stall, seconds = extra
                self.on_interrupt(self.workers[a], t, is_stall, seconds)
            elif kind == _WAVE:
                self.on_wave(t)
            else:
                self.on_other(kind, t, a, b, extra)
        end = self.finished_at
        for w in self.workers:
            self.book(w, end)


class SimulationDiverged(ValueError):
    """Interruptions come faster than the work can be done: the job would never finish."""


# --- the public functions ---------------------------------------------------------


def simulate(scenario: Scenario, strategy: Strategy | str, shard_size: int, seed: int = 0) -> RunResult:
    """One run of the job; the same inputs and seed give the same result."""
    sim = _Sim(scenario, Strategy(strategy), shard_size, seed)
    # A hundred times the makespan without interruptions: a job that takes that
    # long is one whose interruptions outpace its shards.
    shards_per_worker = math.ceil(math.ceil(scenario.items / shard_size) / scenario.workers)
    sim.run(max_seconds=100 * (scenario.ideal_seconds + shards_per_worker * scenario.shard_overhead_seconds))
    written, covered = _coverage(sim.writes)
    end = sim.finished_at
    assert end is not None
    sc = scenario
    return RunResult(
        scenario=sc,
        strategy=Strategy(strategy),
        shard_size=shard_size,
        seed=seed,
        makespan_seconds=end,
        duplicate_rows=written - covered,
        missing_rows=sc.items - covered,
        deaths=sim.deaths,
        stalls=sim.stalls,
        waves=sim.waves,
        splits=sim.splits,
        take_backs=sim.take_backs,
        lost=LostTime(
            reload=sim.load_time - sc.workers * sc.model_load_seconds,
            stall=sim.stall_time,
            overhead=sim.overhead_time,
            redone=sim.compute_time - sc.items / sc.records_per_second,
            idle=sim.idle_time,
        ),
    )


def _coverage(writes: list[tuple[int, int]]) -> tuple[int, int]:
    """(rows written, distinct rows written) from the log of written ranges."""
    written = covered = 0
    reach = -1
    for lo, hi in sorted(writes):
        if hi <= lo:
            continue
        written += hi - lo
        if hi > reach:
            covered += hi - max(lo, reach)
            reach = hi
    return written, covered


def sweep(
    scenario: Scenario,
    strategies: Iterable[Strategy | str],
    shard_sizes: Iterable[int],
    seeds: Sequence[int],
) -> list[SweepRow]:
    """Every strategy at every shard size, averaged over the seeds."""
    rows = []
    for strategy in strategies:
        for size in shard_sizes:
            runs = [simulate(scenario, strategy, size, seed) for seed in seeds]
            hours = [r.makespan_seconds / 3600.0 for r in runs]
            rows.append(SweepRow(
                strategy=Strategy(strategy),
                shard_size=size,
                seeds=len(runs),
                makespan_hours=statistics.fmean(hours),
                makespan_hours_stdev=statistics.stdev(hours) if len(hours) > 1 else 0.0,
                over_ideal=statistics.fmean(r.over_ideal for r in runs),
                gpu_hours_lost=statistics.fmean(r.gpu_hours_lost for r in runs),
                duplicate_rows=statistics.fmean(r.duplicate_rows for r in runs),
                makespans_hours=tuple(hours),
                lost_hours={
                    cause: statistics.fmean(getattr(r.lost, cause) for r in runs) / 3600.0
                    for cause in ("reload", "stall", "overhead", "redone", "idle")
                },
            ))
    return rows


def candidate_shard_sizes(records: int, workers: int, records_per_second: float,
                          shard_overhead_seconds: float) -> list[int]:
    """Shard sizes worth trying: a 1-2-5 series between two bounds.

    Below: a shard must take at least nine times its overhead (overhead at most
    10% of the work), and a job of more than 100,000 shards costs the planner
    more to simulate than it can gain. Above: a worker's whole share of the job.
    """
    largest = max(1, math.ceil(records / workers))
    smallest = max(1, math.ceil(9 * shard_overhead_seconds * records_per_second),
                   math.ceil(records / 100_000))
    sizes = []
    decade = 1
    while decade <= largest:
        for step in (1, 2, 5):
            size = step * decade
            if smallest <= size <= largest:
                sizes.append(size)
        decade *= 10
    if not sizes or sizes[-1] < largest:
        sizes.append(largest)
    return sizes


# Sizes whose expected makespans are this close count as equally good: three
# seeds do not resolve finer differences, nor does the model's simplicity.
SHARD_SIZE_TOLERANCE = 0.01


@dataclass(frozen=True)
class ShardSizeChoice:
    shard_size: int
    curve: list[tuple[int, float]]  # (size, mean makespan in seconds; inf if it never finishes)
    strategy: Strategy
    seeds: int


def choose_shard_size(
    scenario: Scenario,
    *,
    strategy: Strategy | str = Strategy.KEYED_PER_RECORD,
    seeds: int = 3,
    candidates: Sequence[int] | None = None,
) -> ShardSizeChoice:
    """The smallest shard size whose expected makespan is within 1% of the least.

    Among sizes that are as good, the smaller keeps less work behind any one
    lease and reports progress more finely; with tail splitting and per-record
    keys the curve is nearly flat above a few thousand records, and the
    strict minimum would be one shard per worker.
    """
    if seeds < 1:
        raise ValueError("seeds must be at least 1")
    sizes = sorted(set(candidates)) if candidates else candidate_shard_sizes(
        scenario.items, scenario.workers, scenario.records_per_second,
        scenario.shard_overhead_seconds)
    curve: list[tuple[int, float]] = []
    for size in sizes:
        try:
            mean = statistics.fmean(
                simulate(scenario, strategy, size, seed).makespan_seconds for seed in range(seeds)
            )
        except SimulationDiverged:
            mean = math.inf
        curve.append((size, mean))
    best = min(mean for _, mean in curve)
    if best == math.inf:
        raise SimulationDiverged(
            f"at {scenario.interruptions_per_hour:g} interruptions per worker-hour the job "
            "never finishes at any shard size"
        )
    chosen = next(size for size, mean in curve if mean <= best * (1 + SHARD_SIZE_TOLERANCE))
    return ShardSizeChoice(shard_size=chosen, curve=curve, strategy=Strategy(strategy), seeds=seeds)


def recommend_shard_size(
    records: int,
    workers: int,
    records_per_second: float,
    interruptions_per_hour: float,
    *,
    stall_share: float = 0.2,
    model_load_seconds: float = 180,
    lease_seconds: float = 600,
    shard_overhead_seconds: float = 3,
    seeds: int = 3,
    strategy: Strategy | str = Strategy.KEYED_PER_RECORD,
    notice: bool = True,
    tail_split: bool = True,
    take_back: bool = True,
    candidates: Sequence[int] | None = None,
) -> int:
    """The shard size to plan a job with, for `shards.size: auto`.

    The defaults describe batchline's worker and store: keyed per-record writes,
    preemption notices honoured (I5), dead workers' leases taken back on proof, and
    unstarted tails split off to idle workers.
    Raises SimulationDiverged when interruptions outpace the work at every size.
    """
    scenario = Scenario(
        items=records, workers=workers, records_per_second=records_per_second,
        interruptions_per_hour=interruptions_per_hour, stall_share=stall_share,
        model_load_seconds=model_load_seconds, lease_seconds=lease_seconds,
        shard_overhead_seconds=shard_overhead_seconds, notice=notice, tail_split=tail_split, take_back=take_back,
    )
    return choose_shard_size(scenario, strategy=strategy, seeds=seeds, candidates=candidates).shard_size


REFERENCE = Scenario(
    items=2_000_000, workers=20, records_per_second=18.7, interruptions_per_hour=1.0,
    stall_share=0.2, model_load_seconds=180, lease_seconds=600, shard_overhead_seconds=3,
)
REFERENCE_SHARD_SIZES = (500, 5_000, 25_000)
REFERENCE_SEEDS = (0, 1, 2, 3, 4)


def with_batchline(scenario: Scenario) -> Scenario:
    """The same scenario with what batchline adds: notices, take-backs of workers proven
    dead, and tail splitting."""
    return replace(scenario, notice=True, tail_split=True, take_back=True)
