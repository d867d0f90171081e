from __future__ import annotations

import string
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.peers import Istiod, Process, agent, demo

DATA = Path(__file__).parent / "data"


def render(template: str, **values: object) -> str:
    """A YAML fixture from tests/data with $placeholders filled in."""
    return string.Template((DATA / template).read_text()).substitute({k: str(v) for k, v in values.items()})


@pytest.fixture
def mesh_dir(tmp_path: Path) -> Path:
    path = tmp_path / "mesh"
    path.mkdir()
    return path


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in reversed(started):
        process.stop()


@pytest.fixture
def start_istiod(tmp_path: Path, processes: list[Process]) -> Callable[..., Istiod]:
    def start(config_dir: Path, *extra: str) -> Istiod:
        istiod = Istiod(tmp_path, "--config-dir", str(config_dir), "--poll-interval", "100ms", *extra)
        processes.append(istiod)
        return istiod

    return start


@pytest.fixture
def start_demo(processes: list[Process]) -> Callable[..., Process]:
    def start(*args: str, env: dict[str, str] | None = None, name: str = "") -> Process:
        process = demo(*args, env=env, name=name)
        processes.append(process)
        return process

    return start


@pytest.fixture
def start_agent(processes: list[Process]) -> Callable[..., Process]:
    def start(*args: str, name: str = "agent") -> Process:
        process = agent(*args, name=name)
        processes.append(process)
        return process

    return start
