"""XBackendTrafficPolicy as istiod converts it (pilot/pkg/config/kube/gateway/backend_policies.go): the
retry budget of each Service it targets, merged into that Service's generated DestinationRule (see
backend_tls.py, which makes the rule); the oldest policy of a Service wins. The status has an
ancestor per target (the mesh controller's) with Accepted only; sessionPersistence is accepted but
said to be unsupported, as istiod says it.

Pure: policies and Services in, retry budgets by Service and statuses out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from istiod.model.config.gateway_api import BackendTrafficPolicy, StatusKey
from istiod.model.config.networking import RetryBudget
from istiod.model.config.policy_attachment import (
    SERVICE, VALID, find_target, ignored_status, policy_ancestor, target_problem, target_ref,
)

if TYPE_CHECKING:  # (istiod.model.service imports this package: only its type here)
    from istiod.model.service import Service

KIND = "XBackendTrafficPolicy"


def backend_traffic(policies: Iterable[BackendTrafficPolicy], services: Mapping[tuple[str, str], Service],
                    ) -> tuple[dict[tuple[str, str], RetryBudget], dict[StatusKey, dict[str, Any]]]:
    """The retry budget of each targeted Service (namespace, name), and every policy's status."""
    budgets: dict[tuple[str, str], RetryBudget] = {}
    statuses: dict[StatusKey, dict[str, Any]] = {}
    # The oldest first (then namespace and name), so it is the one a Service keeps.
    for policy in sorted(policies, key=lambda p: (p.created, p.meta.namespace, p.meta.name)):
        namespace = policy.meta.namespace
        if policy.ignored:
            statuses[(KIND, namespace, policy.meta.name)] = ignored_status(policy.targets, policy.generation)
            continue
        message = VALID
        if policy.unsupported:
            message += f", but Istio does not support the following fields: {', '.join(policy.unsupported)}"
        ancestors = []
        for target in policy.targets:
            accepted = (True, "Accepted", message)
            problem = target_problem(namespace, target, find_target(namespace, target, services, {}), (SERVICE,))
            if problem is not None:
                accepted = (False, "TargetNotFound", "targetRefs invalid: " + problem)
            elif policy.retry_budget is not None:
                budgets.setdefault((namespace, target.name), policy.retry_budget)
            ancestors.append(policy_ancestor(target_ref(target), accepted, None, policy.generation))
        statuses[(KIND, namespace, policy.meta.name)] = {"ancestors": ancestors}
    return budgets, statuses
