"""`istiod proxy-status`: istioctl's table of sync states, or one proxy's sent-versus-ACKed diff."""

from __future__ import annotations

import sys
from typing import Any

from istiod.debug.views import sync_state
from istiod.tools import tables
from istiod.tools.debug_client import DebugClient

HEADERS = ("NAME", "CLUSTER", "CDS", "LDS", "EDS", "RDS", "ISTIOD", "VERSION")
_COLUMNS = ("cluster", "listener", "endpoint", "route")  # /debug/syncz prefixes of CDS, LDS, EDS, RDS
_TITLES = {"cds": "Clusters", "lds": "Listeners", "eds": "Endpoints", "rds": "Routes"}


def run(client: DebugClient, proxy: str | None) -> int:
    if proxy:
        sys.stdout.write(render_diff(client.get("/debug/sync_diff", proxyID=proxy)))
    else:
        sys.stdout.write(render_table(client.get("/debug/syncz"), client.address))
    return 0


def short_name(proxy_id: str) -> str:
    """istioctl's NAME: `<pod>.<namespace>` from `type~ip~pod.namespace~domain`."""
    parts = proxy_id.split("~")
    return parts[2] if len(parts) == 4 else proxy_id


def render_table(syncs: list[dict[str, Any]], istiod: str) -> str:
    rows = [
        (
            short_name(s["proxy"]),
            s.get("cluster_id", ""),
            *(sync_state(s.get(f"{p}_sent", ""), s.get(f"{p}_acked", ""), s.get(f"{p}_nacked_error", ""))
              for p in _COLUMNS),
            istiod,
            s.get("istio_version") or "-",
        )
        for s in syncs
    ]
    return tables.render(HEADERS, sorted(rows))


def render_diff(diff: dict[str, Any]) -> str:
    lines = [f"Proxy: {diff['proxy']} (connection {diff['connection_id']})"]
    for entry in diff["types"]:
        changes = (
            [f"  + {n}   sent, not ACKed" for n in entry["sent_not_acked"]]
            + [f"  - {n}   ACKed, no longer sent" for n in entry["acked_not_sent"]]
            + [f"  ~ {n}   sent copy differs from the ACKed one" for n in entry["changed"]]
        )
        title = f"{_TITLES.get(entry['type'], entry['type'])} {'Match' if not changes else 'Do Not Match'}"
        status = entry["status"]
        if status == "NACKED":
            title += f" (NACKED version {entry['version_sent']}: {entry['error'].strip()})"
        elif status == "STALE":
            title += f" (STALE: version {entry['version_sent']} sent, {entry['version_acked'] or 'none'} ACKed)"
        elif status == "SYNCED":
            title += f" (version {entry['version_acked']})"
        lines += [title, *changes]
    return "\n".join(lines) + "\n"
