"""CPU and memory of processes from /proc, for the benchmarks' server figures."""

from __future__ import annotations

import os
from pathlib import Path


class ProcessTree:
    """CPU and memory of a process and its descendants, from /proc (a server may fork workers)."""

    def __init__(self, *pids: int) -> None:
        self.roots = pids

    def pids(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int(_stat(entry.name)[1])
                except (OSError, IndexError):
                    continue  # gone meanwhile
                children.setdefault(ppid, []).append(int(entry.name))
        found, todo = [], list(self.roots)
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo.extend(children.get(pid, []))
        return found

    def cpu_seconds(self) -> float:
        """User + system time of every live process of the tree, and of the children they reaped."""
        total = 0
        for pid in self.pids():
            try:
                fields = _stat(str(pid))
            except OSError:
                continue
            total += sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
        return total / os.sysconf("SC_CLK_TCK")

    def memory_mb(self) -> dict[str, float]:
        """RSS now and its peak (VmHWM), summed over the tree: with one process, its own peak; with
        several, an upper bound of the peak of the sum."""
        rss = peak = 0
        for pid in self.pids():
            rss_kb, peak_kb = memory_kb(pid)
            rss, peak = rss + rss_kb, peak + peak_kb
        return {"rss_mb": rss / 1024, "peak_rss_mb": peak / 1024}


def memory_kb(pid: int) -> tuple[int, int]:
    """One process's RSS now and its peak (VmHWM), in kB; zeros for one gone or a zombie."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0, 0
    status = dict(line.split(":", 1) for line in lines)
    if "VmRSS" not in status:
        return 0, 0  # a zombie: it holds no memory
    return int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0])


def _stat(pid: str) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces): state is [0]."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
