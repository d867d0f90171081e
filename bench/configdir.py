"""Benchmark: CPU of watching a config dir of many files, polling (as before) against file events.

    python bench/configdir.py [--files 5000] [--window 10]

Prints, for each way of watching: the CPU used while nothing changes (in cores), how long one edit
takes to reach the store, and the CPU of one full rescan (what the slow resync costs each time).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from istiod.sources import configdir
from istiod.sources.configdir import ConfigDirSource
from istiod.sources.convert import ObjectKey
from istiod.sources.store import Store

POD = """apiVersion: v1
kind: Pod
metadata: {name: p%d, namespace: ns%d, labels: {app: a%d}}
spec: {containers: [{name: c, ports: [{containerPort: 7070}]}]}
status: {podIP: 10.%d.%d.%d, phase: Running, conditions: [{type: Ready, status: "True"}]}
"""


def write_pod(root: Path, i: int, port_app: int = 0) -> None:
    path = root / f"ns{i % 50}" / f"p{i}.yaml"
    path.write_text(POD % (i, i % 50, port_app or i % 100, i // 65536, i // 256 % 256, i % 256))


def no_events() -> None:
    raise OSError("file events turned off for the benchmark")


async def measure(root: Path, files: int, window: float, events: bool) -> None:
    if not events:
        configdir.Inotify = no_events  # type: ignore[assignment,misc]  # the source falls back to polling
    store = Store()
    source = ConfigDirSource(root, store, poll_interval=0.25)
    started = time.perf_counter()
    task = asyncio.create_task(source.run())
    await source.synced.wait()
    synced = time.perf_counter() - started
    await asyncio.sleep(1)  # past the first scan's aftermath
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.sleep(window)
    idle = (time.process_time() - cpu) / (time.perf_counter() - wall)

    key = ObjectKey("Pod", "ns7", "p7")
    started = time.perf_counter()
    write_pod(root, 7, port_app=999)
    while store.get(key).raw["metadata"]["labels"]["app"] != "a999":  # type: ignore[union-attr]
        await asyncio.sleep(0.005)
    latency = time.perf_counter() - started
    write_pod(root, 7)

    cpu = time.process_time()
    await source.scan()
    rescan = time.process_time() - cpu
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    name = "inotify + resync" if events else "polling every 250ms"
    resync = f" (every {configdir.RESYNC:.0f}s: {rescan / configdir.RESYNC:.4f} cores)" if events else ""
    print(f"{name:20} {files} files: first sync {synced:.2f}s, idle CPU {idle:.3f} cores, "
          f"one edit applied in {latency * 1e3:.0f} ms, one full rescan {rescan * 1e3:.0f} ms CPU{resync}")

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--window", type=float, default=10.0, help="seconds of idle CPU measured")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for ns in range(50):
            (root / f"ns{ns}").mkdir()
        for i in range(args.files):
            write_pod(root, i)
        asyncio.run(measure(root, args.files, args.window, events=True))
        asyncio.run(measure(root, args.files, args.window, events=False))


if __name__ == "__main__":
    main()
