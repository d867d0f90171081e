"""Structured logs: one line per event, as key=value pairs (default) or as JSON objects.

An event is a name and its facts, logged as the message:
    log.info(event("ads connected", id=connection.id, peer=connection.peer))
Any handler shows it as `ads connected id=... peer=...`; ours give each fact its own key.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

FORMATS = ("kv", "json")
LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class Event:
    name: str
    facts: Mapping[str, Any]

    def __str__(self) -> str:
        return " ".join([self.name, *(f"{key}={_kv_value(value)}" for key, value in self.facts.items())])


def event(name: str, **facts: Any) -> Event:
    return Event(name, facts)


def one_line(error: BaseException) -> str:
    """An error's text on one line (YAML and kubeconfig errors span several)."""
    return " ".join(str(error).split())


class Throttled:
    """A recurring warning that a client can cause at will: at most one line per `interval` seconds,
    the next line counting the ones left out."""

    def __init__(self, logger: logging.Logger, interval: float = 1.0) -> None:
        self._logger = logger
        self._interval = interval
        self._next = 0.0
        self._dropped = 0

    def warning(self, message: Event) -> None:
        now = time.monotonic()
        if now < self._next:
            self._dropped += 1
            return
        self._next = now + self._interval
        if self._dropped:
            message = Event(message.name, {**message.facts, "suppressed": self._dropped})
            self._dropped = 0
        self._logger.warning(message)


def setup(level: str = "info", output: str = "kv") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if output == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def current() -> tuple[str, str]:
    """The level and output that setup() was given, for a child process to log alike."""
    root = logging.getLogger()
    json = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return logging.getLevelName(root.level).lower(), "json" if json else "kv"


def _record_fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, Any]:
    message = record.msg
    values: dict[str, Any] = {
        "time": datetime.fromtimestamp(record.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "level": record.levelname.lower(),
        "scope": record.name.removeprefix("istiod."),
        "msg": message.name if isinstance(message, Event) else record.getMessage(),
        **(message.facts if isinstance(message, Event) else {}),
    }
    if record.exc_info:
        values["error"] = formatter.formatException(record.exc_info)
    return values


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={_kv_value(value)}" for key, value in _record_fields(record, self).items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_record_fields(record, self), ensure_ascii=False, default=str)


def _kv_value(value: Any) -> str:
    if isinstance(value, Mapping):
        value = ",".join(f"{k}:{v}" for k, v in value.items())
    text = str(value)
    # Quote anything that would split the line or the pair; JSON escaping keeps it one line.
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text
