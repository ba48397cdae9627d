"""Errors a user sees: each carries one readable line that says what and where."""

from __future__ import annotations

# How every one-line error starts on stderr.
ERROR_PREFIX = "batchline: error: "


def one_line(exc: object) -> str:
    """An exception's message (or any text) on one line, as every error here is written."""
    return " ".join(str(exc).split())


def missing_extra(what: str, package: str, extra: str) -> str:
    """The line for a plug-in used where its extra is not installed: what needs which package,
    and the pip command that brings it."""
    return f"{what} need {package}: pip install 'batchline[{extra}]'"


class BatchlineError(Exception):
    """A failure the command line reports as one line on stderr with a non-zero exit."""

    exit_code = 1


class SpecError(BatchlineError):
    """The job spec does not parse or names a field wrongly."""

    exit_code = 2


class ArgumentError(BatchlineError):
    """A command or call was given an argument that cannot be what the caller meant (a
    group with padding, a bare string for a list, a k out of bounds): 2, as argparse
    exits for any other bad argument."""

    exit_code = 2


class InputError(BatchlineError):
    """The input snapshot is malformed, changed since planning, or unreadable."""

    exit_code = 3


class StoreError(BatchlineError):
    """The store refused an operation or cannot be reached."""

    exit_code = 4


class StoreMissing(StoreError):
    """A store that does not exist where a caller that never makes one looked (a SQLite file's
    path with a typo, a scheduled task's connection): nothing was made there."""


class PointerMovedOn(BatchlineError):
    """A scheduled run's publish refused because its name's pointer moved since the run first
    planned (a newer night published; a cleared old run's task would move it back)."""


class PublicationMoved(StoreError):
    """A publish or rollback was refused because the name's publication is no longer the
    one its publisher read before it moved the targets: another publish or rollback of
    the name came in between. Nothing is recorded, and the targets are put back; the
    publisher reads the name again (`batchline history NAME`) and decides anew."""

    exit_code = 9


class OutputUnwritable(BatchlineError):
    """A worker cannot write its shard's file where the job's output says (files: per-shard: the
    staging prefix refuses it, or is not there): 73, sysexits' EX_CANTCREAT. Every worker would
    fail the same way, so no replacement is started; the shard's lease is given back and its
    results stay in the store for the worker that completes it once the prefix is writable."""

    exit_code = 73


class EngineFatal(BatchlineError):
    """The engine cannot go on (process gone, weights wrong, server unreachable).

    Distinct from a per-record error: the worker releases its lease and exits non-zero.
    """

    exit_code = 5


class VersionHalted(BatchlineError):
    """The version's dead letters passed its bound (`shards.abort_dead_letter_rate`): the
    store holds it halted, no worker claims its shards, and the message names the kind
    of dead letter most of them are and one record. No replacement worker would get past
    it; `batchline resume` (with a changed bound) or `batchline cancel` ends the halt."""

    exit_code = 7


class NoSuchVersion(BatchlineError):
    """A command was given a job version (or a published name) the store does not have. No
    worker started later would find it either, so it is fatal, not "no work left" (0),
    which a Kubernetes Job would show as Complete. 66 as sysexits' EX_NOUSER: no such
    addressee."""

    exit_code = 66

    def __init__(self, version: str, where: str, *, or_name: bool = False) -> None:
        what = "job version or published name" if or_name else "job version"
        super().__init__(f"no {what} {version!r} in {where}")


class NotPublished(BatchlineError):
    """A command that reads a name's published version was given a name nothing is published
    under: 66, as for a version the store does not have."""

    exit_code = 66

    def __init__(self, name: str, where: str) -> None:
        super().__init__(f"nothing is published under {name!r} in {where}")


class VersionEnded(BatchlineError):
    """The version was cancelled or deleted: nothing of it runs again, so neither a run nor
    a watch of it can end as asked."""

    ENDED_STATES = frozenset({"cancelled", "removed"})

    def __init__(self, version: str, state: str, where: str) -> None:
        super().__init__(f"{version} was {'cancelled' if state == 'cancelled' else 'deleted'} in {where}; "
                         "nothing of it runs again")


class EngineCrashed(Exception):
    """The engine died under the records in flight (vLLM's engine core killed by a signal,
    a native crash in it) after it had loaded. Not fatal: the engine child exits and the
    supervisor restarts it and bisects the records in flight, as after a segfault, so a
    record that kills the engine costs only itself (I4)."""


class SourceUnavailable(BatchlineError):
    """The input's store cannot be read now (throttled, unreachable, timing out) for
    longer than its bound. Nothing is wrong with the input: a worker gives its shard
    back and exits 75 so that another worker (or this one, later) tries again."""

    exit_code = 75
