"""The `ray` launcher: `batchline launch ray --job VERSION` submitted to a Ray cluster through
its Jobs API, so the fleet is driven from the cluster and outlives the task that submitted it.

The submission id comes from the version and the launch key: a retry, or an intent whose
launch was never recorded, finds the submission that exists instead of making a second one.
The driver reads the store's URL from the cluster's own environment (`BATCHLINE_STORE` on
the head node) unless `store_url_in_runtime_env` is set: a job's runtime environment is
readable by whoever can list the cluster's jobs, so a URL with a password stays out of it
by default. `stop` stops the submission: the driver gets SIGTERM and stops its workers,
which give their leases back (I5).
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Mapping
from typing import Any, ClassVar

from batchline.errors import BatchlineError, SpecError
from batchline.launch import slug
from batchline.launch.fleet import LaunchRequest


def submission_id(request: LaunchRequest, attempt: int = 0) -> str:
    """The submission's id: from the version and the task's key, so a retry finds it, and the
    attempt after the first (a submission that ended without sealing the version, stopped from
    outside or failed, is submitted again under the next)."""
    digest = hashlib.sha256(f"{request.version}\0{request.key}".encode()).hexdigest()[:12]
    return f"batchline-{slug(request.version, 40)}-{digest}" + (f"-{attempt}" if attempt else "")


# The most submissions one key makes: each a whole fleet that ended without sealing its version.
MAX_ATTEMPTS = 50
# The statuses of a submission whose driver still runs (or is about to).
RUNS = ("PENDING", "RUNNING")


class RayJobsLauncher:
    name = "ray"
    options: ClassVar[Mapping[str, str]] = {
        "address": "the cluster's Jobs API (its dashboard), such as http://head:8265 (required)",
        "gpus_per_worker": "GPUs each worker takes (default: 1 where the cluster has GPUs)",
        "cpus_per_worker": "CPUs each worker takes (default 1)",
        "auth_token": "the cluster's token, where it authenticates (a credential: give it in the connection)",
        "store_url_in_runtime_env": "pass the store's URL in the job's environment (default false: the "
                                    "cluster's own BATCHLINE_STORE)",
    }

    def _client(self, request: LaunchRequest) -> Any:
        from ray.job_submission import JobSubmissionClient

        address = request.option("address")
        if not isinstance(address, str) or not address:
            raise SpecError("launcher ray: option address is required (the cluster's Jobs API, http://HEAD:8265)")
        token = request.option("auth_token")
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            return JobSubmissionClient(address, headers=headers)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise BatchlineError(f"launcher ray: cannot reach the Jobs API at {address}: "
                                 f"{' '.join(str(exc).split())[:300]}") from None

    def entrypoint(self, request: LaunchRequest) -> str:
        args = ["batchline", "launch", "ray", "--job", request.version, "--workers", str(request.workers),
                "--address", "auto"]
        for option, flag in (("gpus_per_worker", "--gpus-per-worker"), ("cpus_per_worker", "--cpus-per-worker")):
            if request.option(option) is not None:
                args += [flag, str(float(request.option(option)))]
        if request.deadline is not None:
            args += ["--deadline", request.deadline]
        return shlex.join(args)

    def check(self, request: LaunchRequest) -> None:
        flag = request.option("store_url_in_runtime_env", False)
        if not isinstance(flag, bool):
            raise SpecError("launcher ray: option store_url_in_runtime_env must be true or false")
        self._client(request)

    def launch(self, request: LaunchRequest) -> dict[str, Any]:
        client = self._client(request)
        for attempt in range(MAX_ATTEMPTS):
            sid = submission_id(request, attempt)
            status = self._status(client, sid)
            if status is None:
                break
            if status in RUNS:
                return {"address": request.option("address"), "submission_id": sid, "existing": True}
        else:
            raise BatchlineError(f"launcher ray: {MAX_ATTEMPTS} submissions of this key ended without sealing "
                                 f"{request.version}; launch it under another key once the cause is fixed")
        detail = {"address": request.option("address"), "submission_id": sid}
        env = {"BATCHLINE_STORE": request.store_url} if request.option("store_url_in_runtime_env", False) else {}
        try:
            client.submit_job(entrypoint=self.entrypoint(request), submission_id=sid,
                              runtime_env={"env_vars": env} if env else None,
                              metadata={"batchline_version": request.version})
        except RuntimeError as exc:
            if self._status(client, sid) is None:  # not a race with another try: a refusal
                raise BatchlineError(f"launcher ray: the submission was refused: "
                                     f"{' '.join(str(exc).split())[:300]}") from None
            return {**detail, "existing": True}
        return {**detail, "existing": False}

    @staticmethod
    def _status(client: Any, sid: str) -> str | None:
        """The submission's status (PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED), or None where
        the cluster knows no such submission."""
        try:
            status = client.get_job_info(sid).status
        except RuntimeError:
            return None
        return str(getattr(status, "value", status)).upper()

    def stop(self, request: LaunchRequest, detail: Mapping[str, Any]) -> None:
        client = self._client(request)
        try:
            client.stop_job(str(detail["submission_id"]))
        except RuntimeError as exc:
            raise BatchlineError(f"launcher ray: stopping {detail['submission_id']} was refused: "
                                 f"{' '.join(str(exc).split())[:300]}") from None

    def running(self, request: LaunchRequest, detail: Mapping[str, Any]) -> bool | None:
        """From the Jobs API: a submission pending or running runs; stopped, failed or succeeded
        (its driver ended: the version sealed, or its workers are gone) does not; a cluster that
        cannot be reached from here cannot tell."""
        try:
            status = self._status(self._client(request), str(detail["submission_id"]))
        except Exception:  # the Jobs API unreachable from here: not known here
            return None
        return None if status is None else status in RUNS


RAY_JOBS = RayJobsLauncher()
