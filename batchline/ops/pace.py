"""What a version's deadline came to: met or missed, by how much, its paid starts and cost.

One reading for `status` (of an open, sealed, halted or cancelled version) and `run`'s
summary; the report draws the same figures. The deadline counts from the run start
(`open_run`), the cost is `batchline.sizing.costs`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchline.ops.report.data import version_cost
from batchline.sizing.costs import RunCost
from batchline.spec import stored_spec
from batchline.spec.deadline import Deadline, format_duration
from batchline.store import ReaderStore, require_job


@dataclass(frozen=True)
class PaceOutcome:
    state: str
    deadline: float
    run_start: float
    ended_at: float | None  # its seal
    now: float
    paid_starts: int
    cost: RunCost

    @property
    def met(self) -> bool | None:
        """Sealed by the deadline; None while it can still be (open before the deadline)."""
        if self.ended_at is not None:
            return self.ended_at <= self.deadline
        return False if self.now > self.deadline else None

    @property
    def margin(self) -> float:
        """Seconds to spare (negative: late): from the seal, or from now while it is open."""
        return self.deadline - (self.ended_at if self.ended_at is not None else self.now)

    def line(self) -> str:
        spare = format_duration(abs(self.margin))
        if self.ended_at is not None:
            verdict = (f"met, sealed {spare} before the deadline" if self.met
                       else f"missed, sealed {spare} after the deadline")
        elif self.met is False:
            verdict = f"missed, {self.state} {spare} past the deadline"
        else:
            verdict = f"{self.state}, {spare} left to the deadline"
        starts = f"{self.paid_starts} paid start{'' if self.paid_starts == 1 else 's'}"
        return f"{verdict}; {starts}; {self.cost.describe()}"

    def to_json(self) -> dict[str, object]:
        return {"deadline": self.deadline, "run_start": self.run_start, "sealed_at": self.ended_at,
                "met": self.met, "margin_seconds": self.margin, "paid_starts": self.paid_starts,
                "cost": self.cost.to_json()}


def pace_outcome(store: ReaderStore, version: str, deadline: Deadline | None = None) -> PaceOutcome | None:
    """The outcome of a version with a deadline (the spec's, or `deadline` instead) that has a
    run start; None otherwise."""
    info = require_job(store, version)
    spec = stored_spec(info)
    held = deadline if deadline is not None else spec.deadline
    st = store.status(version)
    if held is None or st.run_start is None:
        return None
    starts = store.paid_slots(version)
    return PaceOutcome(st.state, held.resolve(st.run_start, st.now), st.run_start,
                       info.sealed_at if st.state == "sealed" else None, st.now, len(starts),
                       version_cost(store, info, starts, st.now))
