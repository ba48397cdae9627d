"""Launchers that place worker processes on a cluster: Ray or Kubernetes.

They only place processes. Every decision about who works on what is made in
the store (claims, leases, epochs), so a worker that a launcher loses, or that
a cluster preempts, behaves exactly as one killed anywhere else: its lease
expires or was given back, and another worker picks the shard up.
"""

from __future__ import annotations

from batchline.errors import (
    EngineFatal,
    InputError,
    NoSuchVersion,
    OutputUnwritable,
    SpecError,
    VersionHalted,
)

# Worker exits that mean the job itself is wrong (bad spec, input changed, engine or
# weights broken, the version halted on its dead letters, a version the store does not
# have, an output it cannot write): starting another worker would only repeat them.
FATAL_EXITS = frozenset(e.exit_code for e in (SpecError, InputError, EngineFatal, VersionHalted, NoSuchVersion,
                                              OutputUnwritable))


def slug(text: str, limit: int = 40) -> str:
    """A DNS-label-safe form of a job version (or a job's name) for object and actor names,
    at most `limit` characters. One that must be cut keeps what tells it apart: a version's
    hash (after its `@`), else a digest of the whole text, so two versions of one long name
    never render the same names. One that fits reads as it always did."""
    out = _dns(text)
    if len(out) <= limit:
        return out or "job"
    name, _at, tail = text.rpartition("@")
    keep = _dns(tail) if name else ""
    if not keep:
        import hashlib

        name, keep = text, hashlib.sha256(text.encode()).hexdigest()[:10]
    head = _dns(name)[:max(0, limit - len(keep) - 1)].rstrip("-")
    return f"{head}-{keep}" if head else keep[:limit]


def _dns(text: str) -> str:
    out = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    return out
