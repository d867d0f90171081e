"""Benchmark: memory per xDS connection, proxyless and Envoy-like: Python's (tracemalloc) or all (RSS).

    python bench/connmem.py [--services 200] [--pods 2] [--clients 200] [--watch 5] [--top 8]
                            [--rss [--batches 2] [--kinds proxyless] [--pushes N] [--grpc-arg NAME=VALUE ...]]

An ADS server runs in this process on a mesh of S services, with istiod's gRPC server options; for
each kind of client, equal batches of clients (load generator processes, as bench/load.py's) connect
one after the other and each is waited on until fully configured. The difference between the first
and the last batch is what one more connection costs, apart from what all of them share (the
snapshot, the serialized resources). Prints bytes per connection and, with tracemalloc, where they
were allocated. `--rss` measures this process's RSS instead (no tracemalloc, whose own records
would count): Python's part and gRPC core's native buffers together, also after glibc's malloc_trim,
and the peak; `--grpc-arg` adds or overrides a server option, to see what one costs.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import multiprocessing
import os
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import istiod  # noqa: F401  # before grpc: it sets gRPC core's experiments, read when grpc loads
import grpc
import yaml

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # the e2e helpers that bench/mesh.py uses
import loadgen  # noqa: E402
from mesh import listener, service_yaml  # noqa: E402
from procstat import memory_kb  # noqa: E402

from istiod.keepalive import Keepalive  # noqa: E402
from istiod.sources.store import Store  # noqa: E402
from istiod.xds import admission  # noqa: E402
from istiod.xds.pusher import Pusher  # noqa: E402
from istiod.xds.server import DiscoveryServer, add_to_server  # noqa: E402


def specs(kind: str, first: int, count: int, services: int, watch: int) -> list[loadgen.ClientSpec]:
    if kind == "envoy":
        return [loadgen.ClientSpec(first + i, "envoy", [], services) for i in range(count)]
    return [loadgen.ClientSpec(first + i, "proxyless",
                               [listener((i * watch + k) % services) for k in range(watch)], watch)
            for i in range(count)]


class Batch:
    """One load generator process whose clients stay connected until stopped."""

    def __init__(self, address: str, clients: list[loadgen.ClientSpec]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.control = ctx.Queue()
        self.go, self.stop_flag = ctx.Event(), ctx.Event()  # held here: the child opens them after start()
        self.go.set()
        self.process = ctx.Process(target=loadgen.main, args=(address, clients, self.control, self.go, self.stop_flag))
        self.process.start()

    async def configured(self, timeout: float) -> None:
        while True:
            kind, _ = await asyncio.to_thread(self.control.get, True, timeout)
            if kind == "configured":
                return

    def stop(self) -> None:
        self.stop_flag.set()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def traced(snapshot: tracemalloc.Snapshot) -> int:
    return sum(stat.size for stat in snapshot.statistics("filename"))


async def measure(server: DiscoveryServer, address: str, kind: str, args: argparse.Namespace, first: int,
                  store: Store) -> None:
    batches: list[Batch] = []
    snapshots: list[tracemalloc.Snapshot] = []
    try:
        peaks = []
        for b in range(2):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            batch = Batch(address, specs(kind, first + b * args.clients, args.clients, args.services, args.watch))
            batches.append(batch)
            await batch.configured(args.timeout)
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
            await asyncio.sleep(1)  # the last ACKs handled
            snapshots.append(tracemalloc.take_snapshot())
        assert len(server.connections) == 2 * args.clients, len(server.connections)
        per = (traced(snapshots[1]) - traced(snapshots[0])) / args.clients
        print(f"{kind}: {per / 1024:.1f} KiB per connection ({args.clients} more connections, "
              f"{len(server.connections)} in all); while each batch connected, the peak was "
              f"{', '.join(f'{p / 2**20:.1f}' for p in peaks)} MiB above the memory before it")
        for stat in snapshots[1].compare_to(snapshots[0], "lineno")[:args.top]:
            frame = stat.traceback[0]
            print(f"  {stat.size_diff / args.clients:8.0f} B  {stat.count_diff / args.clients:5.1f} blocks  "
                  f"{Path(frame.filename).name}:{frame.lineno}")
    finally:
        for batch in batches:
            batch.stop()
        await asyncio.sleep(1)


async def measure_rss(server: DiscoveryServer, address: str, kind: str, args: argparse.Namespace, first: int,
                      store: Store) -> None:
    """RSS after each batch, then after malloc_trim (what glibc holds freed but not returned), then
    after each of `--pushes` endpoint changes."""
    batches: list[Batch] = []
    rss: list[int] = []
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    base = memory_kb(os.getpid())[0]
    if args.trace_left:
        tracemalloc.start()
        started = tracemalloc.take_snapshot()
    try:
        for b in range(args.batches):
            batch = Batch(address, specs(kind, first + b * args.clients, args.clients, args.services, args.watch))
            batches.append(batch)
            await batch.configured(args.timeout)
            await asyncio.sleep(1)  # the last ACKs handled
            rss.append(memory_kb(os.getpid())[0])
        ctypes.CDLL(None).malloc_trim(0)  # glibc: give back what is freed but kept
        trimmed = memory_kb(os.getpid())[0]
        assert len(server.connections) == args.batches * args.clients, len(server.connections)
        per = (rss[-1] - rss[0]) * 1024 / ((args.batches - 1) * args.clients)
        print(f"{kind}: {per / 1024:.1f} KiB RSS per connection; RSS after each batch of {args.clients} "
              f"{', '.join(f'{r / 1024:.0f}' for r in rss)} MB, after malloc_trim {trimmed / 1024:.0f} MB, "
              f"peak {memory_kb(os.getpid())[1] / 1024:.0f} MB", flush=True)
        after_pushes = []
        if args.trace_pushes:
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
        for mark in range(args.pushes):  # endpoint changes, each pushed to every client watching the service
            for doc in yaml.safe_load_all(service_yaml(mark % args.services, args.pods, mark + 1)):
                store.apply(doc)
            await asyncio.sleep(args.push_wait)
            gc.collect()
            ctypes.CDLL(None).malloc_trim(0)
            after_pushes.append(memory_kb(os.getpid())[0])
        if args.trace_pushes:
            _print_growth("over the changes", before, args.top)
        if after_pushes:
            print(f"{kind}: RSS after each of {args.pushes} endpoint changes (collected, trimmed): "
                  f"{', '.join(f'{r / 1024:.0f}' for r in after_pushes)} MB; "
                  f"{(after_pushes[-1] - trimmed) / args.batches / args.clients:.1f} KiB per connection more", flush=True)
    finally:
        for batch in batches:
            batch.stop()
        await asyncio.sleep(1)
    await asyncio.sleep(args.push_wait)
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    print(f"{kind}: RSS before the clients {base / 1024:.0f} MB, after they left (collected, trimmed) "
          f"{memory_kb(os.getpid())[0] / 1024:.0f} MB", flush=True)
    if args.trace_left:
        _print_growth("still held", started, args.top)
    tracemalloc.stop()


def _print_growth(what: str, before: tracemalloc.Snapshot, top: int) -> None:
    """Python's allocations since `before`, and where the largest were made."""
    after = tracemalloc.take_snapshot()
    print(f"  Python's allocations {what}: {(traced(after) - traced(before)) / 1024:.0f} KiB")
    for stat in after.compare_to(before, "lineno")[:top]:
        frame = stat.traceback[0]
        print(f"  {stat.size_diff / 1024:8.0f} KiB  {Path(frame.filename).name}:{frame.lineno}")


def grpc_arg(text: str) -> tuple[str, int | str]:
    name, _, value = text.partition("=")
    return name, int(value) if value.lstrip("-").isdigit() else value


async def run(args: argparse.Namespace) -> None:
    store = Store()
    for s in range(args.services):  # the mesh of bench/load.py
        for doc in yaml.safe_load_all(service_yaml(s, args.pods, None)):
            store.apply(doc)
    pusher = Pusher(store, debounce_after=0.01, debounce_max=0.05)
    # No send deadline: tracemalloc slows the server, and a stream it closed would spoil the count.
    discovery = DiscoveryServer(lambda: pusher.snapshot, send_timeout=0)
    pusher.subscribe(discovery.on_push)
    options = dict([*admission.CORE_OPTIONS, *Keepalive().server_options(), *args.grpc_arg])
    server = grpc.aio.server(options=list(options.items()))
    add_to_server(discovery, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    task = asyncio.create_task(pusher.run())
    pusher.publish(full=True)
    discovery.ready = True
    if not args.rss:
        tracemalloc.start()
    try:
        print(f"mesh: {args.services} services x {args.pods} pods; proxyless clients watch {args.watch} services"
              + "".join(f"; {name}={value}" for name, value in args.grpc_arg), flush=True)
        for k, kind in enumerate(args.kinds.split(",")):
            await (measure_rss if args.rss else measure)(discovery, address, kind, args, 100 * k * args.clients, store)
    finally:
        tracemalloc.stop()
        task.cancel()
        await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--services", "-S", type=int, default=200)
    parser.add_argument("--pods", "-P", type=int, default=2)
    parser.add_argument("--clients", "-N", type=int, default=200, help="clients per batch and kind")
    parser.add_argument("--watch", "-K", type=int, default=5, help="services each proxyless client watches")
    parser.add_argument("--top", type=int, default=8, help="allocation sites shown")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--kinds", default="proxyless,envoy", help="kinds of clients, in order")
    parser.add_argument("--rss", action="store_true", help="measure RSS instead of tracemalloc")
    parser.add_argument("--batches", type=int, default=2, help="batches of clients with --rss (at least 2)")
    parser.add_argument("--pushes", type=int, default=0, help="endpoint changes after the batches, with --rss")
    parser.add_argument("--push-wait", type=float, default=2.0, help="seconds after each change")
    parser.add_argument("--trace-pushes", action="store_true", help="with --pushes: Python's allocations over them")
    parser.add_argument("--trace-left", action="store_true",
                        help="with --rss: Python's allocations still held once the clients left")
    parser.add_argument("--grpc-arg", type=grpc_arg, action="append", default=[], metavar="NAME=VALUE",
                        help="a server option added to istiod's (repeatable)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
