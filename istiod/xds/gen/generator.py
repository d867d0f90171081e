"""What every generator is: (snapshot, proxy, requested names or None for a wildcard, cache) -> resources."""

from __future__ import annotations

from collections.abc import Callable

from istiod.model.proxy import Proxy
from istiod.model.snapshot import Snapshot
from istiod.xds.cache import Resource, ResourceCache

Generator = Callable[[Snapshot, Proxy, list[str] | None, ResourceCache], list[Resource]]
