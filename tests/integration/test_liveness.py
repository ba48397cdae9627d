"""Proof that a lease's owner is dead: only what can be proven is, and a reused pid is not the owner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from batchline.worker.liveness import death_proof, pod_death, process_identity, same_host_death


def identity_of_a_process_now_gone() -> dict[str, object]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    identity = process_identity(proc.pid)
    proc.kill()
    proc.wait()
    return identity


def test_a_live_process_is_not_dead() -> None:
    assert same_host_death(process_identity()) is None


def test_a_stopped_process_is_alive() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        assert same_host_death(process_identity(proc.pid)) is None
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_process_that_is_gone_is_proven_dead() -> None:
    identity = identity_of_a_process_now_gone()
    proof = same_host_death(identity)
    assert proof is not None and proof["found"] == "no such process" and proof["pid"] == identity["pid"]


def test_an_unreaped_process_is_proven_dead() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = process_identity(proc.pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # it exits; nobody has waited for it yet
        proof = same_host_death(identity)
        if proof is not None:
            break
        time.sleep(0.01)
    assert proof is not None and "zombie" in proof["found"]
    proc.wait()


def test_a_reused_pid_is_not_taken_for_the_owner() -> None:
    # The owner had this pid, but started at another time: the live process with the pid
    # now is someone else, and the owner is gone.
    me = process_identity()
    owner = {**me, "start": me["start"] - 1}
    proof = same_host_death(owner)
    assert proof is not None and proof["found"].startswith(f"pid {me['pid']} is another process")
    assert death_proof({**me}) is None


def test_nothing_is_proven_from_another_host_or_pid_namespace() -> None:
    gone = identity_of_a_process_now_gone()
    assert same_host_death(gone) is not None
    # A host name alone proves nothing: another boot id is another machine (or a reboot).
    assert same_host_death({**gone, "boot_id": "another-boot"}) is None
    # Pods on one node share the boot id but not the pid namespace.
    assert same_host_death({**gone, "pid_ns": "pid:[4026531999]"}) is None
    assert same_host_death({**gone, "start": None}) is None
    assert death_proof(None) is None


def test_a_pod_is_dead_when_the_api_server_says_it_is_gone_or_replaced() -> None:
    pods = {("batch", "worker-0-abc"): "uid-1"}

    def lookup(namespace: str, pod: str) -> str | None:
        return pods.get((namespace, pod))

    owner = {"pod": "worker-0-abc", "namespace": "batch", "pod_uid": "uid-1"}
    assert pod_death(owner, lookup) is None
    assert pod_death({**owner, "pod": "worker-1-xyz"}, lookup) == {
        "kind": "kubernetes", "namespace": "batch", "pod": "worker-1-xyz", "found": "no such pod"}
    proof = pod_death({**owner, "pod_uid": "uid-0"}, lookup)
    assert proof is not None and "another one" in proof["found"]
    assert pod_death(owner, None) is None  # no rights to ask: nothing proven

    def unreachable(namespace: str, pod: str) -> str | None:
        raise OSError("connection refused")

    assert pod_death(owner, unreachable) is None
