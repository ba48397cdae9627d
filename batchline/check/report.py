"""What a validation reports: each check of the gate, and the whole report recorded with it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Check:
    name: str
    passed: bool
    figure: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class ValidationReport:
    version: str
    passed: bool
    checks: list[Check]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "passed": self.passed, "seconds": round(self.seconds, 3),
                "checks": [asdict(c) for c in self.checks]}

    def table(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [f"{self.version}: {'PASSED' if self.passed else 'FAILED'} ({self.seconds:.2f}s)"]
        for c in self.checks:
            lines.append(f"  {c.name:<{width}}  {'pass' if c.passed else 'FAIL'}  {printable(c.figure)}")
            # A grader's first failures, so a failed gate says which records and why.
            for example in (c.details.get("failing") or [])[:EXAMPLES_PRINTED]:
                lines.append(f"  {'':<{width}}        {printable(str(example.get('id')))}: "
                             f"{printable(str(example.get('why')))}")
        return "\n".join(lines)


EXAMPLES_PRINTED = 3


def printable(text: str) -> str:
    """Text from records and outputs, safe on a terminal: a control character (an escape
    sequence's start among them) is written as its Python escape."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
