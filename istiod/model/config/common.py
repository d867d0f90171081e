"""Values shared by Istio's config kinds: string matches, workload selectors, exportTo, durations."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import re2  # type: ignore[import-untyped]

Labels = tuple[tuple[str, str], ...]  # sorted (key, value) pairs, as Service.selector
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is an error we report, not a line on stderr
# The largest compiled RE2 program a proxy accepts. Envoy's default (100) refuses even `\pL` and
# NACKs the whole route configuration; Istio's bootstrap raises it to this (the runtime key
# re2.max_program_size.error_level), and so does ours; validation refuses what is larger.
RE2_MAX_PROGRAM_SIZE = 32768


def compile_regex(pattern: str) -> Any:
    """RE2, the syntax Envoy, gRPC and istiod's Go validation share; raises re2.error."""
    return re2.compile(pattern, _RE2_OPTIONS)


def regex_problem(pattern: str) -> str | None:
    """Why a proxy would refuse `pattern` (not RE2, or a program over RE2_MAX_PROGRAM_SIZE), or None."""
    try:
        size = compile_regex(pattern).programsize
    except Exception as error:  # re2.error and its pybind11 relatives
        detail = error.args[0] if error.args else error
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else detail
        return f"{pattern!r} is not a valid RE2 regex: {detail}"
    if size > RE2_MAX_PROGRAM_SIZE:
        return (f"{pattern!r} compiles to an RE2 program of size {size}, "
                f"over the proxies' limit of {RE2_MAX_PROGRAM_SIZE} (re2.max_program_size.error_level)")
    return None


class MatchKind(enum.Enum):
    EXACT = "exact"
    PREFIX = "prefix"
    REGEX = "regex"


@dataclass(frozen=True, slots=True)
class StringMatch:
    kind: MatchKind
    value: str

    def matches(self, text: str, ignore_case: bool = False) -> bool:
        if self.kind is MatchKind.REGEX:
            return compile_regex(self.value).fullmatch(text) is not None
        value = self.value.lower() if ignore_case else self.value
        text = text.lower() if ignore_case else text
        return text == value if self.kind is MatchKind.EXACT else text.startswith(value)


def selector_matches(selector: Labels, labels: Mapping[str, str]) -> bool:
    """A workloadSelector's matchLabels; an empty selector matches every workload."""
    return all(labels.get(k) == v for k, v in selector)


@dataclass(frozen=True, slots=True)
class Meta:
    """Where an object lives; translation names its output after it."""

    name: str
    namespace: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


Duration = timedelta
