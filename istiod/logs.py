"""Structured logs: one line per event, as key=value pairs (default) or as JSON objects.

Callers name an event in the message and pass its facts as fields:
    log.info("ads connected", extra=fields(id=connection.id, peer=connection.peer))
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

FORMATS = ("kv", "json")
LEVELS = ("debug", "info", "warning", "error")
_FIELDS = "istiod_fields"


def fields(**values: Any) -> dict[str, Any]:
    """The `extra=` argument that attaches key=value facts to one log record."""
    return {_FIELDS: values}


def setup(level: str = "info", output: str = "kv") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if output == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _record_fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, Any]:
    values: dict[str, Any] = {
        "time": datetime.fromtimestamp(record.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "level": record.levelname.lower(),
        "scope": record.name.removeprefix("istiod."),
        "msg": record.getMessage(),
        **getattr(record, _FIELDS, {}),
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
