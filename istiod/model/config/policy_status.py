"""The status of a Gateway API policy (BackendTLSPolicy, XBackendTrafficPolicy) as istiod writes it:
an ancestor per target it attaches to, with its conditions."""

from __future__ import annotations

from typing import Any

from istiod.model.config.gateway_api import IGNORE_POLICY_ATTACHMENT, MESH_CONTROLLER, ParentRef, condition

Condition = tuple[bool, str, str]  # status, reason, message


def target_ref(target: ParentRef) -> dict[str, Any]:
    """The ancestorRef of a policy's target."""
    ref: dict[str, Any] = {"group": target.group, "kind": target.kind, "name": target.name}
    if target.section_name:
        ref["sectionName"] = target.section_name
    return ref


def policy_ancestor(ref: dict[str, Any], accepted: Condition, resolved: Condition | None, generation: int,
                    controller: str = MESH_CONTROLLER) -> dict[str, Any]:
    """One ancestor: Accepted, and ResolvedRefs for policies that refer to other objects."""
    conditions = [condition("Accepted", *accepted, generation)]
    if resolved is not None:
        conditions.append(condition("ResolvedRefs", *resolved, generation))
    return {"ancestorRef": ref, "controllerName": controller, "conditions": conditions}


def ignored_ancestor(target: ParentRef, generation: int) -> dict[str, Any]:
    """istiod's ignoredPolicyStatus: the target's ancestor, Accepted false, and no other condition."""
    message = f"Ignored by Istio due to annotation {IGNORE_POLICY_ATTACHMENT}=true"
    return policy_ancestor(target_ref(target), (False, "IgnoredByIstio", message), None, generation)
