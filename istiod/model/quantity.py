"""Kubernetes `resource.Quantity`: the exact grammar, exact values, canonical form.

    quantity ::= signedNumber suffix
    number   ::= digits | digits "." digits | digits "." | "." digits
    suffix   ::= binarySI (Ki Mi Gi Ti Pi Ei) | decimalSI (n u m "" k M G T P E) | ("e"|"E") signedInt
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

Format = Literal["BinarySI", "DecimalSI", "DecimalExponent"]

_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_BY_EXPONENT = {exp: suffix for suffix, exp in _DECIMAL.items()}
# A bound on `e` exponents so a hostile object cannot make us build a million-digit number.
MAX_EXPONENT = 1000
_NUMBER = re.compile(r"([+-]?)(\d+\.?\d*|\.\d+)(.*)", re.ASCII | re.DOTALL)
_EXPONENT = re.compile(r"[eE]([+-]?\d+)", re.ASCII)


class QuantityError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Quantity:
    value: Fraction
    format: Format

    def ceil(self) -> int:
        """The value as a whole number, rounded up as Kubernetes' Value() does."""
        return math.ceil(self.value)

    def canonical(self) -> str:
        """Kubernetes' canonical spelling; sub-nano precision is rounded up to nanos, as it does."""
        value = Fraction(math.ceil(self.value * 10**9), 10**9)
        if self.format == "BinarySI" and value.denominator == 1 and value != 0:
            return _binary_form(value.numerator)
        mantissa, exponent = _decimal_mantissa(value)
        if self.format == "DecimalExponent":
            return f"{mantissa}e{exponent}" if exponent else str(mantissa)
        return f"{mantissa}{_DECIMAL_BY_EXPONENT[exponent]}"

    def __str__(self) -> str:
        return self.canonical()


def parse_quantity(text: str) -> Quantity:
    """Parse a Quantity exactly; raises QuantityError naming what is wrong."""
    match = _NUMBER.fullmatch(text)
    if not match:
        raise QuantityError(f"quantity {text!r} does not start with a number")
    sign, number, suffix = match.groups()
    whole, _, frac = number.partition(".")
    value = Fraction(int(whole or "0") * 10 ** len(frac) + int(frac or "0"), 10 ** len(frac))
    if sign == "-":
        value = -value
    if suffix in _BINARY:
        return Quantity(value * 2 ** _BINARY[suffix], "BinarySI")
    if suffix in _DECIMAL:
        return Quantity(value * Fraction(10) ** _DECIMAL[suffix], "DecimalSI")
    exp_match = _EXPONENT.fullmatch(suffix)
    if not exp_match:
        raise QuantityError(f"quantity {text!r} has an unknown suffix {suffix!r}")
    exponent = int(exp_match.group(1))
    if abs(exponent) > MAX_EXPONENT:
        raise QuantityError(f"quantity {text!r} has an exponent beyond ±{MAX_EXPONENT}")
    return Quantity(value * Fraction(10) ** exponent, "DecimalExponent")


def _binary_form(value: int) -> str:
    for suffix, shift in sorted(_BINARY.items(), key=lambda item: -item[1]):
        if value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


def _decimal_mantissa(value: Fraction) -> tuple[int, int]:
    """The largest multiple-of-3 exponent (-9..18) that leaves a whole mantissa."""
    if value == 0:
        return 0, 0
    for exponent in range(18, -10, -3):
        scaled = value / Fraction(10) ** exponent
        if scaled.denominator == 1:
            return scaled.numerator, exponent
    raise AssertionError("values are rounded to nanos before this")
