"""Benchmark: server CPU per proxyless connection, without gRPC: for the connect storm
(LDS -> RDS -> CDS -> EDS, each ACKed) and for pushes after a change.

    python bench/connect.py [--services 1000] [--pods 2] [--proxyless 2000] [--watch 5] [--profile N]

The DiscoveryServer runs in this process; its clients are bench/load.py's proxyless clients
(loadgen.Client, the same names and following), driven through in-memory streams, so what is
measured is what the server computes per connection and per push, apart from gRPC's own cost
(bench/load.py measures everything). Client work is timed apart and left out. Scenarios: the
storm; a new Service every client watches; an AuthorizationPolicy (inbound listeners only); a
DestinationRule on one watched host. `--profile N` prints each scenario's top N functions (cProfile).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import yaml

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # the istiod of this checkout
import loadgen  # noqa: E402
from load import EVERYONE_MARK, client_specs  # noqa: E402
from mesh import service_name, service_yaml  # noqa: E402

from istiod.sources.store import Store  # noqa: E402
from istiod.xds.pusher import Pusher  # noqa: E402
from istiod.xds.server import DiscoveryServer  # noqa: E402


class Stream:
    """One client's stream: what DiscoveryServer.stream uses of a ServicerContext, and its requests.
    Responses are handled as they are written, as loadgen's SotW client does."""

    def __init__(self, bench: Bench, client: loadgen.Client) -> None:
        self.bench, self.client = bench, client
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_code(self, code: grpc.StatusCode) -> None:
        pass

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass

    def set_details(self, details: str) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise SystemExit(f"stream aborted: {code} {details}")

    def send(self, type_url: str) -> None:
        version, nonce = self.client.versions.get(type_url, ("", ""))
        self.client.enqueue(self.queue, loadgen.discovery_pb2.DiscoveryRequest(
            type_url=type_url, resource_names=sorted(self.client.names[type_url]),
            version_info=version, response_nonce=nonce))

    async def write(self, response: Any) -> None:
        started = time.process_time()  # CPU, not wall: the machine may be busy
        if isinstance(response, bytes):  # the server writes responses serialized once (istiod.xds.wire)
            response = loadgen.discovery_pb2.DiscoveryResponse.FromString(response)
        client, now = self.client, time.time()
        held = client.resources[response.type_url]
        previous = dict(held)
        if response.type_url in (loadgen.LDS, loadgen.CDS):
            held.clear()
        for packed in response.resources:
            name = loadgen.leading_name(packed.value)
            held[name] = loadgen.hold(client, response.type_url, name, packed.value, previous.get(name), now)
        client.versions[response.type_url] = (response.version_info, response.nonce)
        client.answered.add(response.type_url)
        self.send(response.type_url)
        for type_url, names in self.bench.worker._follow(client, response.type_url, now).items():
            if names != client.names.get(type_url):
                client.subscribe(type_url, names)
                self.send(type_url)
        self.bench.client_cpu += time.process_time() - started


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.store = Store()
        for s in range(args.services):
            for doc in yaml.safe_load_all(service_yaml(s, args.pods, None)):
                self.store.apply(doc)
        self.pusher = Pusher(self.store)
        self.server = DiscoveryServer(lambda: self.pusher.snapshot)
        self.pusher.subscribe(self.server.on_push)
        self.server.ready = True
        self.worker = loadgen.Worker("", client_specs(argparse.Namespace(
            proxyless=args.proxyless, services=args.services, watch=args.watch, envoy=0, delta=False,
            ztunnel=0, pods=args.pods, nodes=None)))
        self.client_cpu = 0.0
        self.tasks: list[asyncio.Task[None]] = []
        self.streams: list[Stream] = []

    def connect(self, client: loadgen.Client) -> None:
        stream = Stream(self, client)
        self.streams.append(stream)

        async def requests() -> AsyncIterator[Any]:
            while (request := await stream.queue.get()) is not None:
                yield request

        client.subscribe(loadgen.LDS, set(client.spec.listeners))
        stream.send(loadgen.LDS)
        self.tasks.append(asyncio.create_task(
            self.server.StreamAggregatedResources(requests(), stream)))  # type: ignore[arg-type]

    def idle(self) -> bool:
        return (all(s.queue.empty() for s in self.streams)
                and all(not c._push_queued and c._request is None for c in self.server.connections.values()))

    async def scenario(self, name: str, start: Callable[[], None], done: Callable[[], bool]) -> None:
        profile = cProfile.Profile() if self.args.profile else None
        self.client_cpu = 0.0
        cpu, wall = time.process_time(), time.perf_counter()
        if profile:
            profile.enable()
        start()
        quiet = 0
        while quiet < 10:  # done, and nothing left to do for some turns of the loop
            await asyncio.sleep(0)
            quiet = quiet + 1 if done() and self.idle() else 0
        if profile:
            profile.disable()
        server_cpu = time.process_time() - cpu - self.client_cpu
        per = server_cpu / len(self.worker.clients) * 1e3
        print(f"{name}: server {server_cpu:.2f} s CPU, {per:.2f} ms per connection "
              f"(wall {time.perf_counter() - wall:.2f} s, clients {self.client_cpu:.2f} s)", flush=True)
        if profile:
            pstats.Stats(profile).sort_stats("tottime").print_stats(self.args.profile)

    def apply(self, *docs: dict[str, Any]) -> None:
        for doc in docs:
            self.store.apply(doc)
        self.pusher.publish()


async def run(args: argparse.Namespace) -> None:
    bench = Bench(args)
    clients = bench.worker.clients
    print(f"mesh: {args.services} services x {args.pods} pods; {len(clients)} proxyless clients watching "
          f"{args.watch} each", flush=True)
    await bench.scenario("storm", lambda: [bench.connect(c) for c in clients],
                         lambda: all(c.configured_at is not None for c in clients))
    await bench.scenario("new Service every client watches",
                         lambda: bench.apply(*yaml.safe_load_all(service_yaml(-1, 1, EVERYONE_MARK))),
                         lambda: all(EVERYONE_MARK in c.seen for c in clients))
    name, namespace = service_name(0)
    await bench.scenario("AuthorizationPolicy (inbound listeners)", lambda: bench.apply({
        "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
        "metadata": {"name": "deny-x", "namespace": "bench"},
        "spec": {"action": "DENY", "rules": [{"to": [{"operation": {"paths": ["/x"]}}]}]}}), lambda: True)
    await bench.scenario("DestinationRule on one host", lambda: bench.apply({
        "apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"host": f"{name}.{namespace}.svc.cluster.local",
                 "trafficPolicy": {"loadBalancer": {"simple": "ROUND_ROBIN"}}}}), lambda: True)
    for task in bench.tasks:
        task.cancel()
    await asyncio.gather(*bench.tasks, return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--proxyless", type=int, default=2000)
    parser.add_argument("--watch", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
