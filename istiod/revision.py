"""Control plane revisions, as Istio's: the `istio.io/rev` label on namespaces, pods and config, the
names each revision's objects take, and the injection webhooks' selectors Istio's chart writes (a
revision's own, and a revision tag's). Pure: names and dicts in, names and dicts out.

A revision `X` is served by the istiod started with `--revision X` (or `REVISION=X`); the revision
`default` (an empty one means it too) keeps Istio's unsuffixed names (`istiod`, `istio`,
`istio-sidecar-injector`). A revision tag is another name for a revision: a MutatingWebhookConfiguration
`istio-revision-tag-<tag>` labelled `istio.io/tag=<tag>` and `istio.io/rev=<revision>`, whose
webhooks select `istio.io/rev=<tag>` and call the revision's istiod.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

DEFAULT = "default"
REV_LABEL = "istio.io/rev"
TAG_LABEL = "istio.io/tag"
INJECTION_LABEL = "istio-injection"  # the default revision's namespace switch
INJECT_LABEL = "sidecar.istio.io/inject"
ISTIO_NAMESPACE = "istio-system"
INJECTOR_WEBHOOK_SUFFIX = "sidecar-injector.istio.io"  # the webhooks istiod's patcher fills (Istio's webhookName)
TAG_PREFIX = "istio-revision-tag-"


def canonical(revision: str) -> str:
    """The revision as labels spell it: empty is `default`."""
    return revision or DEFAULT


def _suffix(revision: str) -> str:
    return "" if canonical(revision) == DEFAULT else f"-{revision}"


def service_name(revision: str) -> str:
    """The istiod Service (and Deployment) of a revision: `istiod`, `istiod-<rev>`."""
    return f"istiod{_suffix(revision)}"


def mesh_configmap(revision: str) -> str:
    """The mesh config ConfigMap a revision reads: `istio`, `istio-<rev>`."""
    return f"istio{_suffix(revision)}"


def injector_configmap(revision: str) -> str:
    """The injector ConfigMap a revision reads: `istio-sidecar-injector[-<rev>]`."""
    return f"istio-sidecar-injector{_suffix(revision)}"


def injector_name(revision: str, namespace: str = ISTIO_NAMESPACE) -> str:
    """The revision's MutatingWebhookConfiguration (the chart adds the namespace outside istio-system)."""
    name = injector_configmap(revision)
    return name if namespace == ISTIO_NAMESPACE else f"{name}-{namespace}"


def validator_name(revision: str, namespace: str = ISTIO_NAMESPACE) -> str:
    """The revision's ValidatingWebhookConfiguration: `istio-validator[-<rev>]-<istio namespace>`."""
    return f"istio-validator{_suffix(revision)}-{namespace}"


def tag_webhook_name(tag: str, namespace: str = ISTIO_NAMESPACE) -> str:
    name = f"{TAG_PREFIX}{tag}"
    return name if namespace == ISTIO_NAMESPACE else f"{name}-{namespace}"


def labels_in_revision(labels: Mapping[str, str] | None, revision: str) -> bool:
    """Istio's LabelsInRevision: config without `istio.io/rev` is every revision's; labelled, only its own."""
    labelled = (labels or {}).get(REV_LABEL)
    return labelled is None or not revision or labelled == revision


def _expression(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, **({"values": list(values)} if values else {})}


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels, matchExpressions) against labels, as the API server
    evaluates a webhook's namespaceSelector and objectSelector; None or {} selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"matchExpressions: unknown operator {operator!r}")
    return True


def injection_webhooks(revision: str, client_config: Mapping[str, Any], *,
                       default_hooks: bool | None = None) -> list[dict[str, Any]]:
    """The webhooks of `istio-sidecar-injector[-<rev>]` (or of a tag, with the tag as `revision`), with
    Istio's names and selectors: `rev.namespace.` (namespace `istio.io/rev=<rev>`), `rev.object.` (pod
    `istio.io/rev=<rev>` in an unlabelled namespace); and for the default revision (or the tag
    `default`) also `namespace.` (`istio-injection=enabled`) and `object.` (pod `sidecar.istio.io/inject=true`)."""
    label = canonical(revision)
    opted_out = _expression(INJECT_LABEL, "NotIn", "false")
    hooks = [
        ("rev.namespace.", [_expression(REV_LABEL, "In", label), _expression(INJECTION_LABEL, "DoesNotExist")],
         [opted_out]),
        ("rev.object.", [_expression(REV_LABEL, "DoesNotExist"), _expression(INJECTION_LABEL, "DoesNotExist")],
         [opted_out, _expression(REV_LABEL, "In", label)]),
    ]
    if default_hooks if default_hooks is not None else label == DEFAULT:
        hooks += [
            ("namespace.", [_expression(INJECTION_LABEL, "In", "enabled")], [opted_out]),
            ("object.", [_expression(INJECTION_LABEL, "DoesNotExist"), _expression(REV_LABEL, "DoesNotExist")],
             [_expression(INJECT_LABEL, "In", "true"), _expression(REV_LABEL, "DoesNotExist")]),
        ]
    return [{
        "name": f"{prefix}{INJECTOR_WEBHOOK_SUFFIX}",
        "clientConfig": copy.deepcopy(dict(client_config)),
        "sideEffects": "None",
        "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
        "failurePolicy": "Fail",
        "reinvocationPolicy": "Never",
        "admissionReviewVersions": ["v1"],
        "namespaceSelector": {"matchExpressions": namespace},
        "objectSelector": {"matchExpressions": pod},
    } for prefix, namespace, pod in hooks]


def webhook_revision(config: Mapping[str, Any]) -> str:
    """The revision a webhook configuration belongs to (its `istio.io/rev` label); ValueError if none."""
    revision = ((config.get("metadata") or {}).get("labels") or {}).get(REV_LABEL)
    if not revision:
        name = (config.get("metadata") or {}).get("name", "")
        raise ValueError(f"MutatingWebhookConfiguration {name} has no {REV_LABEL} label")
    return str(revision)


def tag_configuration(tag: str, revision_config: Mapping[str, Any], namespace: str = ISTIO_NAMESPACE) -> dict[str, Any]:
    """istioctl's `tag set`: the tag's MutatingWebhookConfiguration, calling the same endpoint (and
    trusting the same caBundle) as the revision's own injector webhook `revision_config`."""
    revision = webhook_revision(revision_config)
    hook = next((h for h in revision_config.get("webhooks") or [] if str(h.get("name", "")).endswith(INJECTOR_WEBHOOK_SUFFIX)),
                None)
    if hook is None:
        name = (revision_config.get("metadata") or {}).get("name", "")
        raise ValueError(f"could not find sidecar-injector webhook in canonical webhook {name!r}")
    # The revision's labels but `app`, as istioctl's (the app names what the object does, not whose it is).
    labels = {k: v for k, v in ((revision_config.get("metadata") or {}).get("labels") or {}).items() if k != "app"}
    labels.update({TAG_LABEL: tag, REV_LABEL: revision, "app": "sidecar-injector"})
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": tag_webhook_name(tag, namespace), "labels": labels},
        "webhooks": injection_webhooks(tag, hook.get("clientConfig") or {}, default_hooks=tag == DEFAULT),
    }


NEVER_MATCH = {"matchLabels": {"istio.io/deactivated": "never-match"}}  # istioctl's


def deactivated(config: Mapping[str, Any]) -> dict[str, Any]:
    """istioctl's `tag set default`: the default revision's own injector, kept but matching nothing,
    so that only the tag `default` takes its namespaces."""
    result: dict[str, Any] = copy.deepcopy(dict(config))
    for hook in result.get("webhooks") or []:
        hook["namespaceSelector"] = copy.deepcopy(NEVER_MATCH)
        hook["objectSelector"] = copy.deepcopy(NEVER_MATCH)
    return result


def injecting_webhooks(configs: list[Mapping[str, Any]], namespace_labels: Mapping[str, str],
                       pod_labels: Mapping[str, str]) -> list[tuple[str, str]]:
    """(configuration, webhook) pairs whose selectors take a pod: what the API server would call."""
    return [(str(c["metadata"]["name"]), str(h["name"])) for c in configs for h in c.get("webhooks") or []
            if selects(h.get("namespaceSelector"), namespace_labels) and selects(h.get("objectSelector"), pod_labels)]
