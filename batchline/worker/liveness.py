"""Proving a lease's owner dead, so its lease is taken back at once instead of running out.

A claimer tells the store who it is (`process_identity`): host, boot id, pid
namespace, pid and the pid's start time, and where it runs on Kubernetes its pod
(the launcher's manifests give it, from the downward API). Another worker, or the
runner that started it, takes a lease back only on proof:

- same host: the same boot id (a host name alone proves nothing) and the same pid
  namespace (pods on one node share the boot id but not the pid namespace, so a
  worker in another namespace proves nothing), and the pid is gone, is a zombie,
  or belongs to a process started at another time (a reused pid is not the owner);
- Kubernetes: the API server says the owner's pod is gone (or is another pod of
  that name), asked with the rights the manifests grant (get pods, nothing else);
- Ray: the launcher saw the owner's actor die.

A stopped process (SIGSTOP) is alive; what cannot be proven waits for the lease to
run out. A misjudged owner can only lose its later writes: a take-back is fenced
on its epoch and bumps it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchline.store import LeaseHolder, WorkerStore

POD_ENV = {"pod": "BATCHLINE_POD_NAME", "namespace": "BATCHLINE_POD_NAMESPACE", "pod_uid": "BATCHLINE_POD_UID"}
RAY_ACTOR_ENV = "BATCHLINE_RAY_ACTOR"
RAY_NODE_ENV = "BATCHLINE_RAY_NODE"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """The process's state letter and start time (clock ticks after boot), or None if there is none."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields follow the last ')'.
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def process_identity(pid: int | None = None) -> dict[str, Any]:
    pid = os.getpid() if pid is None else pid
    stat = _stat(pid)
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    identity: dict[str, Any] = {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
                                "pid_ns": pid_ns, "pid": pid, "start": stat[1] if stat else None}
    for key, env in POD_ENV.items():
        if os.environ.get(env):
            identity[key] = os.environ[env]
    if os.environ.get(RAY_ACTOR_ENV):
        identity["ray_actor"] = os.environ[RAY_ACTOR_ENV]
    if os.environ.get(RAY_NODE_ENV):
        identity["ray_node"] = os.environ[RAY_NODE_ENV]
    return identity


def same_host_death(owner: dict[str, Any], here: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Proof that a process on this host (boot and pid namespace) is gone, or None."""
    here = here or process_identity()
    if not owner.get("boot_id") or owner.get("boot_id") != here.get("boot_id"):
        return None
    if not owner.get("pid_ns") or owner.get("pid_ns") != here.get("pid_ns"):
        return None
    pid, start = owner.get("pid"), owner.get("start")
    if not isinstance(pid, int) or start is None:
        return None
    proof = {"kind": "same-host", "host": owner.get("host"), "boot_id": owner["boot_id"], "pid": pid,
             "start": start}
    stat = _stat(pid)
    if stat is None:
        return {**proof, "found": "no such process"}
    state, found_start = stat
    if found_start != start:
        return {**proof, "found": f"pid {pid} is another process, started at {found_start}"}
    if state == "Z":
        return {**proof, "found": "the process has exited (zombie)"}
    return None


def signal_same_host(owner: dict[str, Any], signum: int) -> bool:
    """Sends `signum` to the process `owner` describes, only if it runs on this host (boot and
    pid namespace) and is the very process (its start time): False otherwise."""
    here = process_identity()
    if not owner.get("boot_id") or owner.get("boot_id") != here.get("boot_id") or \
            owner.get("pid_ns") != here.get("pid_ns"):
        return False
    pid, start = owner.get("pid"), owner.get("start")
    stat = _stat(pid) if isinstance(pid, int) else None
    if stat is None or start is None or stat[1] != start:
        return False
    try:
        os.kill(int(pid), signum)  # type: ignore[arg-type]
    except ProcessLookupError:
        return False
    return True


PodLookup = Callable[[str, str], str | None]  # (namespace, pod) -> the pod's uid, None if there is no such pod


def kubernetes_pod_lookup() -> PodLookup | None:
    """Asks the API server about pods, with the service account's own rights (in a pod)."""
    try:
        from kubernetes import client, config
        from kubernetes.client.exceptions import ApiException
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except Exception:
        return None
    api = client.CoreV1Api()

    def lookup(namespace: str, pod: str) -> str | None:
        try:
            meta = api.read_namespaced_pod(pod, namespace).metadata
            return str(meta.uid) if meta is not None else ""
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
    return lookup


def pod_death(owner: dict[str, Any], lookup: PodLookup | None) -> dict[str, Any] | None:
    if lookup is None or not owner.get("pod") or not owner.get("namespace"):
        return None
    try:
        uid = lookup(str(owner["namespace"]), str(owner["pod"]))
    except Exception:
        return None  # the API server could not say: nothing is proven
    proof = {"kind": "kubernetes", "namespace": owner["namespace"], "pod": owner["pod"]}
    if uid is None:
        return {**proof, "found": "no such pod"}
    if owner.get("pod_uid") and uid != owner["pod_uid"]:
        return {**proof, "found": f"the pod is another one now (uid {uid})"}
    return None


def death_proof(owner: dict[str, Any] | None, lookup: PodLookup | None = None) -> dict[str, Any] | None:
    if not owner:
        return None
    return same_host_death(owner) or pod_death(owner, lookup)


def take_back_dead(store: WorkerStore, version: str, by: str, *, lookup: PodLookup | None = None,
                   proof_of: Callable[[LeaseHolder], dict[str, Any] | None] | None = None) -> int:
    """Takes back every lease of `version` whose owner is proven dead; returns how many."""
    taken = 0
    for holder in store.leases(version):
        proof = proof_of(holder) if proof_of is not None else death_proof(holder.process, lookup)
        if proof is not None and store.take_back(version, holder, by, proof):
            taken += 1
    return taken
