"""Istio's environment variables as flag defaults, read with the flag's own parser."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def env_default(name: str, default: str, parse: Callable[[str], T]) -> T:
    """$name (else `default`) parsed as its flag would be; a bad value stops istiod with one line naming it."""
    text = os.environ.get(name, default)
    try:
        return parse(text)
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise SystemExit(f"istiod: environment variable {name}={text!r} is not valid: {error}") from None


def parse_bool(text: str) -> bool:
    """Go's strconv.ParseBool, as istiod reads its boolean variables."""
    if text in ("1", "t", "T", "true", "TRUE", "True"):
        return True
    if text in ("0", "f", "F", "false", "FALSE", "False"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} must be true or false")


def resolve_hostname_gateways() -> bool:
    """Istio's RESOLVE_HOSTNAME_GATEWAYS (default true): network gateways may be named by hostname."""
    return env_default("RESOLVE_HOSTNAME_GATEWAYS", "true", parse_bool)
