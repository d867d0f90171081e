"""`istiod tag set|list|remove`: revision tags, as `istioctl tag`. A tag is the MutatingWebhookConfiguration
istio-revision-tag-<tag> (see istiod.revision.tag_configuration) built from the revision's own injector
webhook; namespaces labelled istio.io/rev=<tag> are then injected by that revision's istiod."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.config import ConfigException

from istiod.kubeapi import api_client
from istiod.operator.install import apply
from istiod.revision import DEFAULT, ISTIO_NAMESPACE, REV_LABEL, TAG_LABEL, deactivated, tag_configuration
from istiod.sources.kube import API_ERRORS, describe_error

TAG_CREATED = """Revision tag {tag!r} created, referencing control plane revision {revision!r}. To enable injection using this
revision tag, use 'kubectl label namespace <NAMESPACE> istio.io/rev={tag}'
"""


class TagError(RuntimeError):
    """What istioctl would refuse, in its words."""


def add_tag_flags(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    set_ = actions.add_parser("set", allow_abbrev=False, help="point a tag at a revision (create or, with --overwrite, move it)")
    set_.add_argument("tag")
    set_.add_argument("-r", "--revision", required=True, help="Control plane revision to reference from a given revision tag")
    set_.add_argument("--overwrite", action="store_true",
                      help="allow moving an existing tag (otherwise an existing tag is refused)")
    set_.add_argument("--generate", action="store_true", help="print the webhook configuration instead of applying it")
    list_ = actions.add_parser("list", allow_abbrev=False, help="the tags, their revisions and the namespaces using them")
    remove = actions.add_parser("remove", allow_abbrev=False, help="delete a tag")
    remove.add_argument("tag")
    remove.add_argument("-y", "--skip-confirmation", action="store_true",
                        help="remove even when namespaces still use the tag")
    for sub in (set_, list_, remove):
        sub.set_defaults(parser=sub)
        sub.add_argument("--kubeconfig", type=Path, help="the cluster (default $KUBECONFIG, else the in-cluster config)")
        sub.add_argument("-i", "--istioNamespace", dest="istio_namespace", default=ISTIO_NAMESPACE,
                         help=f"Istio system namespace (default {ISTIO_NAMESPACE})")


def run_tag(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        asyncio.run(_run(args, out))
    except (TagError, ValueError, ConfigException) as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    except API_ERRORS as error:  # the API refused, or is unreachable
        print(f"Error: {describe_error(error)}", file=sys.stderr)
        return 1
    return 0


async def _run(args: argparse.Namespace, out: TextIO) -> None:
    kubeconfig = args.kubeconfig or (Path(os.environ["KUBECONFIG"]) if os.environ.get("KUBECONFIG") else None)
    async with await api_client(kubeconfig) as api:
        admission, core = client.AdmissionregistrationV1Api(api), client.CoreV1Api(api)
        if args.action == "set":
            await set_tag(api, admission, args.tag, args.revision, args.istio_namespace, args.overwrite, args.generate, out)
        elif args.action == "list":
            await list_tags(admission, core, out)
        else:
            await remove_tag(admission, core, args.tag, args.skip_confirmation, out)


async def set_tag(api: client.ApiClient, admission: client.AdmissionregistrationV1Api, tag: str, revision: str,
                  namespace: str, overwrite: bool, generate: bool, out: TextIO) -> None:
    own = (await admission.list_mutating_webhook_configuration(label_selector=f"{REV_LABEL}={revision},!{TAG_LABEL}")).items
    if (await admission.list_mutating_webhook_configuration(label_selector=f"{REV_LABEL}={tag},!{TAG_LABEL}")).items \
            and tag != DEFAULT:
        raise TagError(f"cannot create revision tag {tag!r}: found existing control plane revision with same name")
    if not own:
        raise TagError(f"cannot modify tag: cannot find MutatingWebhookConfiguration with revision {revision!r}")
    if len(own) > 1:
        raise TagError(f"cannot modify tag: found multiple canonical webhooks with revision {revision!r}")
    existing = (await admission.list_mutating_webhook_configuration(label_selector=f"{TAG_LABEL}={tag}")).items
    if existing and not overwrite:
        raise TagError(f"revision tag {tag!r} already exists, and --overwrite is false")
    config = tag_configuration(tag, api.sanitize_for_serialization(own[0]), namespace)
    if generate:
        out.write(yaml.safe_dump(config, sort_keys=False))
        return
    if tag == DEFAULT:
        await deactivate_default_injector(api, admission)
    await apply(api, f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{config['metadata']['name']}",
                config)
    out.write(TAG_CREATED.format(tag=tag, revision=revision))


async def deactivate_default_injector(api: client.ApiClient, admission: client.AdmissionregistrationV1Api) -> None:
    """As istioctl: the default revision's injector (not a tag) matches nothing from now on, so the tag
    `default` alone takes istio-injection=enabled namespaces; a second such injector is refused."""
    configs = (await admission.list_mutating_webhook_configuration(label_selector=f"{REV_LABEL}={DEFAULT},!{TAG_LABEL}")).items
    if len(configs) > 1:
        raise TagError("failed deactivating existing default revision: expected a single webhook for default revision")
    for config in configs:  # a replace carries the resourceVersion read: a concurrent change is a conflict
        await admission.replace_mutating_webhook_configuration(  # the client sends a dict body as it is
            config.metadata.name, deactivated(api.sanitize_for_serialization(config)))  # type: ignore[arg-type]


async def _namespaces(core: client.CoreV1Api, tag: str) -> list[str]:
    return sorted(n.metadata.name for n in (await core.list_namespace(label_selector=f"{REV_LABEL}={tag}")).items)


async def list_tags(admission: client.AdmissionregistrationV1Api, core: client.CoreV1Api, out: TextIO) -> None:
    rows: dict[str, str] = {}
    for config in (await admission.list_mutating_webhook_configuration(label_selector=TAG_LABEL)).items:
        labels = config.metadata.labels or {}
        rows.setdefault(labels[TAG_LABEL], labels.get(REV_LABEL, ""))
    if not rows:
        out.write("No Istio revision tags found.\n")
        return
    table = [("TAG", "REVISION", "NAMESPACES")] + [(tag, revision, ",".join(await _namespaces(core, tag)))
                                                  for tag, revision in sorted(rows.items())]
    widths = [max(len(row[i]) for row in table) for i in range(2)]
    for tag, revision, namespaces in table:  # as Go's tabwriter with padding 1
        out.write(f"{tag.ljust(widths[0])} {revision.ljust(widths[1])} {namespaces}".rstrip() + "\n")


async def remove_tag(admission: client.AdmissionregistrationV1Api, core: client.CoreV1Api, tag: str,
                     skip_confirmation: bool, out: TextIO) -> None:
    configs: list[Any] = (await admission.list_mutating_webhook_configuration(label_selector=f"{TAG_LABEL}={tag}")).items
    if not configs:
        raise TagError(f"cannot remove tag {tag!r}: cannot find MutatingWebhookConfiguration or Service for tag")
    namespaces = await _namespaces(core, tag)
    if namespaces and not skip_confirmation:  # istioctl asks; without a terminal to ask, refuse
        raise TagError(f"Caution, found {len(namespaces)} namespace(s) still injected by tag {tag!r}: "
                       f"{' '.join(namespaces)}; pass --skip-confirmation to remove it anyway")
    for config in configs:
        await admission.delete_mutating_webhook_configuration(config.metadata.name)
    out.write(f"Revision tag {tag} removed\n")

