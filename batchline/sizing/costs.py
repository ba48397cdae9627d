"""What a run's worker time cost: one model for `run`'s summary, `status` and the report.

Worker time is counted from the store's own records, in two parts:

- **paid time**: each paid start, from its worker's first heartbeat to its stop (the
  store's `paid_workers` rows, whose times the database keeps), at the spec's
  `fallback.cost_per_worker_hour`;
- **spot time**: the lease time of every worker that is not paid, at the spec's
  `fallback.spot_cost_per_worker_hour`, or the price the caller gives where the spec
  has none (the report's `--gpu-hour-price`); unpriced otherwise, never a built-in
  price.

Worker time is called what it is: GPU-hours where the engine computes on GPUs,
worker-hours otherwise (a CPU run, the synthetic engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchline.spec import JobSpec


def time_unit(computes_on: str | None) -> str:
    """GPU-hours for an engine whose workers compute on GPUs (as its `computes_on` says),
    worker-hours for any other."""
    return "GPU-hours" if computes_on is not None and computes_on.startswith("a GPU") else "worker-hours"


@dataclass(frozen=True)
class WorkerPrices:
    spot: float | None  # per spot worker-hour; None: not priced
    paid: float | None  # per paid worker-hour; None: the spec buys none
    unit: str  # GPU-hours or worker-hours

    @classmethod
    def of(cls, spec: JobSpec, computes_on: str | None, spot_price: float | None = None) -> WorkerPrices:
        fallback = spec.fallback
        spot = fallback.spot_cost_per_worker_hour if fallback is not None else None
        return cls(spot if spot is not None else spot_price,
                   fallback.cost_per_worker_hour if fallback is not None else None, time_unit(computes_on))


@dataclass(frozen=True)
class RunCost:
    prices: WorkerPrices
    spot_seconds: float
    paid_seconds: float

    @property
    def spot_cost(self) -> float | None:
        return None if self.prices.spot is None else self.spot_seconds / 3600.0 * self.prices.spot

    @property
    def paid_cost(self) -> float:
        return self.paid_seconds / 3600.0 * (self.prices.paid or 0.0)

    @property
    def total(self) -> float | None:
        """Spot and paid together; None when spot time was spent and has no price."""
        if self.spot_cost is None and self.spot_seconds > 0:
            return None
        return (self.spot_cost or 0.0) + self.paid_cost

    def per_thousand(self, answered: int) -> float | None:
        total = self.total
        return None if total is None or answered <= 0 else total / answered * 1000.0

    def hours(self, seconds: float) -> str:
        return f"{seconds / 3600.0:,.3f} {self.prices.unit}"

    def describe(self) -> str:
        """One line: each part's time and cost, and the total."""
        spot = self.hours(self.spot_seconds) + " spot" + (
            f" at {self.prices.spot:g}/h" if self.prices.spot is not None else " (no spot price)")
        paid = self.hours(self.paid_seconds) + " paid" + (
            f" at {self.prices.paid:g}/h" if self.prices.paid is not None else "")
        total = self.total
        return f"{spot}, {paid}: " + (f"cost {total:,.2f}" if total is not None else "cost not priced")

    def to_json(self) -> dict[str, object]:
        return {"unit": self.prices.unit, "spot_seconds": self.spot_seconds, "paid_seconds": self.paid_seconds,
                "spot_price_per_hour": self.prices.spot, "paid_price_per_hour": self.prices.paid,
                "spot_cost": self.spot_cost, "paid_cost": self.paid_cost, "total": self.total}
