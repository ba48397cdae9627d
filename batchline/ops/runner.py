"""`batchline run`: plan if new, keep N local worker processes alive, show progress.

The runner only places processes: every decision about who works on what is
made in the store, so a worker killed here behaves as one lost anywhere. It
outlives a store outage: while the store cannot be read it keeps supervising
its workers and starts nothing new (a worker that exits is seen to once the
store answers), and once it has not been able to pace for a lease it stops its
paid workers, whose spend it can no longer hold.
"""

from __future__ import annotations

import collections
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, TypeVar

from batchline.errors import ERROR_PREFIX, BatchlineError, StoreError
from batchline.launch import FATAL_EXITS
from batchline.launch.pacer import Pacer, PaceReport
from batchline.sizing.paced import Trace
from batchline.spec import stored_spec
from batchline.spec.deadline import Deadline, format_duration, format_rate
from batchline.store import JobStatus, Store, require_job
from batchline.store.paid import PaidSlot
from batchline.worker.liveness import death_proof, signal_same_host, take_back_dead
from batchline.worker.regions import REGION_ENV
from batchline.worker.supervisor import EXIT_DONE, EXIT_PREEMPTED

__all__ = ["PACE_TICK_SECONDS", "LocalRunner", "RateMeter", "RunSummary", "WorkerFailed", "default_log_dir",
           "format_duration", "progress_line", "store_key"]

# How often a local run's pacer decides.
PACE_TICK_SECONDS = 2.0

# Worker exits that mean the job itself is wrong (input changed, engine or
# weights broken, bad usage): restarting would only repeat them.

RATE_WINDOW_SECONDS = 60.0
# The progress line's rate is measured between the commits of about this long: outcomes are
# committed in bursts (a write batch, a shard's end), and an ETA that follows each burst swings
# by hours on a steady run.
RATE_SMOOTHING_SECONDS = 300.0
RUNNER = "runner"
RUNNER_RECONNECT_SECONDS = 5.0
T = TypeVar("T")


class WorkerFailed(BatchlineError):
    """A worker stopped on something no replacement would get past (the spec, the input,
    the engine): the run fails with the worker's own exit status and meaning."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class _Slot:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    starts: int = 0
    name: str | None = None  # a paid slot's (paid-0, ...); None for a spot worker
    reclaimed: bool = False  # a drill's spot trace has taken it away for now


@dataclass
class RunSummary:
    status: JobStatus
    seconds: float
    worker_starts: int
    restarts: int
    log_dir: Path
    exit_code: int = 0
    answered_before: int = 0  # records with an outcome when this run began (carried, or a run before)
    paid_starts: int = 0  # paid workers its pacer started
    pace: PaceReport | None = None  # what its pacer saw last
    reclaims: int = 0  # spot workers a drill's spot trace killed

    @property
    def answered(self) -> int:
        """Records this run answered: what a rate "this run" divides."""
        return self.status.results + self.status.dead_letters - self.answered_before


class RateMeter:
    """Outcomes a second for the progress line and its ETA. Outcomes are committed in bursts
    (a write batch, a shard's end), so the rate is measured between commits, not between
    samples: from the first to the last commit seen within `window` seconds, which on a
    steady run is its pace whatever the bursts, so the ETA shown a minute apart moves by a
    minute. Once no commit has come for twice the usual gap between them, the time since the
    first counts too and the rate falls; before two commits, the average since the first
    sample."""

    def __init__(self, window: float = RATE_SMOOTHING_SECONDS) -> None:
        self.window = window
        self._first: tuple[float, int] | None = None
        self._commits: collections.deque[tuple[float, int]] = collections.deque()
        self.rate: float | None = None

    def add(self, now: float, done: int) -> float | None:
        if self._first is None:
            self._first = (now, done)
            self._commits.append((now, done))
            return None
        if done != self._commits[-1][1]:
            self._commits.append((now, done))
        while len(self._commits) > 2 and now - self._commits[1][0] > self.window:
            self._commits.popleft()
        (t0, d0), (t1, d1) = self._commits[0], self._commits[-1]
        if len(self._commits) >= 3 and t1 > t0:
            gap = (t1 - t0) / (len(self._commits) - 1)
            self.rate = (d1 - d0) / (t1 - t0 if now - t1 <= 2 * gap else now - t0)
        elif now - self._first[0] >= 1.0:
            self.rate = (done - self._first[1]) / (now - self._first[0])
        return self.rate


class LocalPaid:
    """Paid workers as local processes (`batchline run` with a `fallback` section): the
    `PaidLauncher` of batchline.launch.pacer. A slot's worker this runner did not start (one a
    runner before it started, still running) is stopped through its process identity."""

    def __init__(self, runner: LocalRunner, stop_seconds: float) -> None:
        self.runner = runner
        self.stop_seconds = stop_seconds
        self.slots: dict[str, _Slot] = {}

    def start(self, version: str, slot: str, generation: int) -> None:
        own = self.slots.setdefault(slot, _Slot(len(self.slots), name=slot))
        self.runner._spawn(own, ["--paid-slot", f"{slot}/{generation}"])

    def stop(self, version: str, start: PaidSlot, *, outright: bool = False) -> None:
        signum = signal.SIGKILL if outright else signal.SIGTERM
        own = self.slots.get(start.slot)
        if own is not None and own.proc is not None and own.proc.poll() is None:
            own.proc.send_signal(signum)
        elif start.process:
            signal_same_host(start.process, signum)

    def gone(self, version: str, start: PaidSlot) -> bool:
        own = self.slots.get(start.slot)
        if own is not None and own.proc is not None:
            return own.proc.poll() is not None
        return start.process is not None and death_proof(start.process) is not None

    def alive(self) -> int:
        return sum(1 for s in self.slots.values() if s.proc is not None and s.proc.poll() is None)


class LocalRunner:
    def __init__(self, store: Store, version: str, workers: int, *, log_dir: Path | None = None,
                 out: IO[str] = sys.stderr, refresh_seconds: float | None = None, max_restarts: int | None = None,
                 deadline: Deadline | None = None, pace: bool = True, spot_trace: Trace | None = None,
                 tick_seconds: float = PACE_TICK_SECONDS, region: str | None = None) -> None:
        self.store = store
        self.region = region  # the region its workers are in (BATCHLINE_REGION in their environment)
        self.version = version
        self.workers = workers
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="batchline-logs-"))
        self.out = out
        # A terminal's line is redrawn every second; a log gets a line every ten.
        self.refresh_seconds = refresh_seconds or (1.0 if out.isatty() else 10.0)
        self.max_restarts = max_restarts if max_restarts is not None else 5 * workers + 5
        self.deadline = deadline
        self.spot_trace = spot_trace
        self.tick_seconds = tick_seconds
        self._stop_requested = False
        self._meter = RateMeter()
        spec = stored_spec(require_job(store, version))
        self.deadline = deadline or spec.deadline
        self.paid: LocalPaid | None = None
        self.pacer: Pacer | None = None
        self.last_pace: PaceReport | None = None
        self.reclaims = 0
        self.lease_seconds = spec.shards.lease_seconds
        # The loop is the runner's retry: a call that waits out a long outage would leave the
        # workers unsupervised meanwhile.
        store.reconnect_seconds = min(store.reconnect_seconds, RUNNER_RECONNECT_SECONDS)
        self._unreachable_since: float | None = None  # monotonic: the store has not answered since
        self._paid_stopped_for_outage = False
        if pace and spec.fallback is not None:
            self.paid = LocalPaid(self, spec.shards.grace_seconds)
            self.pacer = Pacer(store, version, self.paid, tick_seconds=tick_seconds, by=RUNNER, spec=spec,
                               deadline_override=deadline, log=self._say)

    def _say(self, line: str) -> None:
        self.out.write(("\n" if self.out.isatty() else "") + f"pacer: {line}\n")
        self.out.flush()

    def _spawn(self, slot: _Slot, extra: Sequence[str] = ()) -> None:
        slot.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        slot.log = self.log_dir / f"worker-{slot.name or slot.index}.log"
        log = slot.log.open("ab")
        # The URL goes in the environment, not on the command line, where any user of
        # the machine could read a PostgreSQL password in the process list.
        slot.proc = subprocess.Popen(
            [sys.executable, "-m", "batchline", "worker", "--job", self.version, *extra],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            env={**os.environ, "BATCHLINE_STORE": self.store.url,
                 **({REGION_ENV: self.region} if self.region is not None else {})},
        )
        log.close()

    def _follow_trace(self, slots: list[_Slot], elapsed: float) -> None:
        """A drill's spot capacity: at most as many spot workers as the trace allows now; the
        extra ones are killed outright, as a reclaim would, and started again when it allows."""
        assert self.spot_trace is not None
        allowed = min(len(slots), self.spot_trace.at(elapsed))
        up = [s for s in slots if s.proc is not None and s.proc.poll() is None]
        for slot in up[allowed:]:
            assert slot.proc is not None
            slot.proc.kill()
            slot.proc.wait()
            slot.reclaimed = True
            self.reclaims += 1
        if up[allowed:]:
            self._guarded(lambda: take_back_dead(self.store, self.version, RUNNER), None)
        for slot in [s for s in slots if s.reclaimed][:max(0, allowed - len(up))]:
            slot.reclaimed = False
            self._spawn(slot)

    def _guarded(self, call: Callable[[], T], unreachable: T) -> T:
        """`call()`, or `unreachable` while the store cannot be read: said once when it stops
        answering and once when it answers again; past a lease without it, the paid workers
        (whose spend cannot be held now) are stopped."""
        try:
            result = call()
        except StoreError as exc:
            now = time.monotonic()
            if self._unreachable_since is None:
                self._unreachable_since = now
                self._say(f"the store cannot be read now ({' '.join(str(exc).split())}): supervising the workers, "
                          "starting nothing new")
            elif now - self._unreachable_since > self.lease_seconds and not self._paid_stopped_for_outage:
                self._paid_stopped_for_outage = True
                stopping = [s for s in (self.paid.slots.values() if self.paid is not None else ())
                            if s.proc is not None and s.proc.poll() is None]
                for slot in stopping:
                    assert slot.proc is not None
                    slot.proc.send_signal(signal.SIGTERM)
                if stopping:
                    self._say(f"no pacing for {self.lease_seconds:g} s (a lease): stopping the paid workers")
            return unreachable
        if self._unreachable_since is not None:
            self._say(f"the store answers again after {format_duration(time.monotonic() - self._unreachable_since)}")
            self._unreachable_since = None
            self._paid_stopped_for_outage = False
        return result

    @property
    def store_unreachable(self) -> bool:
        return self._unreachable_since is not None

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._stop_requested = True

    def run(self) -> RunSummary:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        self.store.open_run(self.version, RUNNER)
        before = self.store.status(self.version)
        slots = [_Slot(i) for i in range(self.workers)]
        # Handlers can be set from the main thread only; run from another one (an
        # orchestrator's task thread) the runner leaves the process's signals alone.
        handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        restarts = 0
        exit_code = 0
        try:
            for slot in slots[:self.spot_trace.at(0.0) if self.spot_trace is not None else len(slots)]:
                self._spawn(slot)
            for slot in slots[self.spot_trace.at(0.0):] if self.spot_trace is not None else ():
                slot.reclaimed = True
            last_draw = last_pace = 0.0
            while True:
                if self._stop_requested:
                    exit_code = self._stop_all(slots)
                    break
                elapsed = time.monotonic() - started
                if self.spot_trace is not None:
                    self._follow_trace(slots, elapsed)
                if self.pacer is not None and time.monotonic() - last_pace >= self.tick_seconds:
                    last_pace = time.monotonic()
                    self._pace()
                alive = self.paid.alive() if self.paid is not None else 0
                for slot in [*slots, *(self.paid.slots.values() if self.paid is not None else ())]:
                    if slot.reclaimed:
                        alive += 1  # taken away for now: it comes back when the trace allows
                        continue
                    code = slot.proc.poll() if slot.proc else EXIT_DONE
                    if code is None:
                        if slot.name is None:
                            alive += 1
                        continue
                    if slot.proc is None or code == EXIT_DONE:
                        slot.proc = None
                        continue
                    if self.store_unreachable:
                        alive += 1  # seen to, and replaced if need be, once the store answers
                        continue
                    # Its leases need not run out: this runner saw the process end.
                    if self._guarded(lambda: take_back_dead(self.store, self.version, RUNNER), None) is None:
                        alive += 1
                        continue
                    if code in FATAL_EXITS:
                        self._stop_all(slots)
                        raise WorkerFailed(code, f"worker {slot.name or slot.index}: {self._last_line(slot)} "
                                                 f"(log: {slot.log})")
                    if slot.name is not None:
                        # A paid worker that stopped or died is its pacer's to start again, while the
                        # job is still behind (its start in the store says which slot it was).
                        slot.proc = None
                        continue
                    restarts += 1
                    if restarts > self.max_restarts:
                        self._stop_all(slots)
                        raise BatchlineError(f"workers keep failing ({restarts} restarts); last: "
                                             f"{self._last_line(slot)} (log: {slot.log})")
                    self._spawn(slot)  # exit 75 or a crash: the store has the work, start another
                    alive += 1
                status = self._guarded(lambda: self.store.status(self.version), None)
                if status is None:
                    time.sleep(0.2)
                    continue
                now = time.monotonic()
                if now - last_draw >= self.refresh_seconds or alive == 0:
                    self._draw(status, self._running(slots), now - started)
                    last_draw = now
                if self.workers == 0 and status.state == "ready":
                    alive += 1  # its workers run elsewhere (scheduled worker slots, a fleet): wait for them
                if alive == 0 or (status.state == "sealed" and not self._any_alive(slots)):
                    break
                time.sleep(0.2)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.out.isatty():
                self.out.write("\n")
        status = self.store.status(self.version)
        if exit_code == 0 and status.state != "sealed":
            exit_code = EXIT_PREEMPTED
        paid = self.paid.slots.values() if self.paid is not None else ()
        return RunSummary(status, time.monotonic() - started, sum(s.starts for s in slots), restarts,
                          self.log_dir, exit_code, before.results + before.dead_letters,
                          paid_starts=sum(s.starts for s in paid), pace=self.last_pace, reclaims=self.reclaims)

    def _running(self, slots: list[_Slot]) -> int:
        """Worker processes running now, spot and paid."""
        every = [*slots, *(self.paid.slots.values() if self.paid is not None else ())]
        return sum(1 for s in every if s.proc is not None and s.proc.poll() is None)

    def _any_alive(self, slots: list[_Slot]) -> bool:
        return self._running(slots) > 0

    def _pace(self) -> None:
        assert self.pacer is not None
        self.last_pace = self._guarded(self.pacer.tick, self.last_pace)

    def _stop_all(self, slots: list[_Slot]) -> int:
        slots = [*slots, *(self.paid.slots.values() if self.paid is not None else ())]
        procs = [s.proc for s in slots if s.proc and s.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
        return EXIT_PREEMPTED

    @staticmethod
    def _last_line(slot: _Slot) -> str:
        """The worker's own one-line error (without its `batchline: error:` prefix, which the
        run's message adds once)."""
        if slot.log is None or not slot.log.exists():
            return "no log"
        lines = [ln for ln in slot.log.read_text(errors="replace").splitlines() if ln.strip()]
        if not lines:
            return f"exit status {slot.proc.returncode if slot.proc else '?'}"
        return lines[-1].removeprefix(ERROR_PREFIX)

    def rate(self, now: float, done: int) -> float | None:
        return self._meter.add(now, done)

    def _draw(self, st: JobStatus, alive: int, elapsed: float) -> None:
        done = st.results + st.dead_letters
        rate = self.rate(time.monotonic(), done)
        deadline = self.deadline.resolve(st.run_start, st.now) if self.deadline is not None else None
        line = progress_line(st, rate, alive, elapsed, deadline)
        if self.last_pace is not None:
            line += " | " + self.last_pace.line()
        self.out.write(("\r" if self.out.isatty() else "") + line + ("" if self.out.isatty() else "\n"))
        self.out.flush()


def progress_line(st: JobStatus, rate: float | None, alive: int | None, elapsed: float | None,
                  deadline: float | None) -> str:
    done = st.results + st.dead_letters
    pct = 100.0 * done / st.records if st.records else 100.0
    parts = [f"{done:,}/{st.records:,} records ({pct:.1f}%)"]
    if st.stopped is not None:
        # No worker gets past what stopped it: a rate and an ETA would promise an end.
        parts.append(f"stopped: {st.stopped}")
    elif rate is not None:
        parts.append(f"{format_rate(rate)} rec/s")
        remaining = st.records - done
        if remaining and rate > 0:
            eta = remaining / rate
            text = f"ETA {format_duration(eta)}"
            if deadline is not None:
                slack = deadline - (st.now + eta)
                text += " (on time)" if slack >= 0 else f" ({format_duration(-slack)} past the deadline)"
            parts.append(text)
    if alive is not None:
        parts.append(f"{alive} workers")
    parts.append(f"{st.dead_letters:,} dead letters")
    parts.append(f"{st.leases_lost} leases lost")
    if st.leases_taken_back:
        parts.append(f"{st.leases_taken_back} taken back")
    if elapsed is not None:
        parts.append(format_duration(elapsed))
    return " | ".join(parts)


def store_key(store_url: str) -> str:
    """A short, stable name for a store: its kind and a digest of where it is (a SQLite
    file's absolute path; a PostgreSQL URL without its password), so one job run on two
    stores keeps two sets of logs and no password reaches a folder name."""
    if store_url.startswith("sqlite:///"):
        kind, place = "sqlite", str(Path(store_url[len("sqlite:///"):]).resolve())
    else:
        parts = urllib.parse.urlsplit(store_url)
        netloc = parts.netloc.rpartition("@")
        user = netloc[0].partition(":")[0]
        query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != "password"]
        kind = "postgresql"
        place = urllib.parse.urlunsplit(("postgresql", f"{user}@{netloc[2]}" if user else netloc[2], parts.path,
                                         urllib.parse.urlencode(query), ""))
    return f"{kind}-{hashlib.sha256(place.encode()).hexdigest()[:12]}"


def default_log_dir(store_url: str, version: str) -> Path:
    """A folder of this run's own: under $BATCHLINE_LOG_DIR (or the temp folder), by
    version, store and run (when it started, and this process), so that neither a rerun
    nor a run of the same job on another store appends to an earlier run's logs."""
    base = Path(os.environ.get("BATCHLINE_LOG_DIR", tempfile.gettempdir()))
    parent = base / "batchline-logs" / version.replace("@", "-") / store_key(store_url)
    run = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    folder, n = parent / run, 1
    while folder.exists():  # a second run from this process within the same second
        n += 1
        folder = parent / f"{run}-{n}"
    return folder
