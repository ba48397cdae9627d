"""Everything `launch k8s` prints, composed: the workers' objects (`batchline.launch.k8s`) and,
with a fallback, the pacer's (`batchline.launch.k8s_pacer`), in the order they are applied."""

from __future__ import annotations

from typing import Any

from batchline.errors import BatchlineError
from batchline.launch.k8s import (
    K8sOptions,
    check_cron,
    kueue_sample,
    priority_class,
    scheduled_control,
    scheduled_job,
    service_account,
    spec_config_map,
    worker_job,
)
from batchline.launch.k8s_isolation import admission_policy, network_policies
from batchline.launch.k8s_pacer import pacer_objects


def render(o: K8sOptions) -> list[dict[str, Any]]:
    if o.workers < 1:
        raise BatchlineError("--workers must be at least 1")
    if o.preemption_notice not in ("none", "aws", "gcp"):
        raise BatchlineError(f"--preemption-notice must be aws, gcp or none, not {o.preemption_notice!r}")
    common = [*(kueue_sample(o) if o.kueue_sample else []), priority_class(o), service_account(o),
              *network_policies(o)]
    if o.schedule is None:
        paid = pacer_objects(o) if o.fallback is not None else []
        return [*common, *(worker_job(o, i) for i in range(o.workers)), *paid]
    check_cron(o.schedule.cron)
    return [*common, spec_config_map(o), scheduled_control(o), *(scheduled_job(o, i) for i in range(o.workers))]


def render_cluster_objects(o: K8sOptions) -> list[dict[str, Any]]:
    """`launch k8s --cluster-objects`: the cluster-scoped objects batchline's namespaced ones rely
    on, for whoever administers the cluster: the admission policy for the pacer's Jobs."""
    return admission_policy(o)
