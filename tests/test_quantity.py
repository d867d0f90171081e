"""resource.Quantity: the grammar, exact values, and canonical round-trips (hypothesis)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from istiod.model.quantity import Quantity, QuantityError, parse_quantity


@pytest.mark.parametrize(
    ("text", "value", "canonical"),
    [
        ("10Gi", 10 * 2**30, "10Gi"),
        ("1.5Gi", 3 * 2**29, "1536Mi"),
        ("1536Mi", 1536 * 2**20, "1536Mi"),
        ("2048Ki", 2 * 2**20, "2Mi"),
        ("1Ei", 2**60, "1Ei"),
        ("100m", Fraction(1, 10), "100m"),
        ("0.5", Fraction(1, 2), "500m"),
        ("1k", 1000, "1k"),
        ("1E", 10**18, "1E"),
        ("1e3", 1000, "1e3"),
        ("1E3", 1000, "1e3"),
        ("12e-3", Fraction(12, 1000), "12e-3"),
        ("+5M", 5 * 10**6, "5M"),
        ("-7", -7, "-7"),
        (".5Ki", 512, "512"),
        ("5.", 5, "5"),
        ("1n", Fraction(1, 10**9), "1n"),
        ("1.0000000001", Fraction(10000000001, 10**10), "1000000001n"),  # rounded up to nanos
        ("0", 0, "0"),
    ],
)
def test_parse_exact_values(text: str, value: Fraction | int, canonical: str) -> None:
    quantity = parse_quantity(text)
    assert quantity.value == value
    assert quantity.canonical() == canonical


@pytest.mark.parametrize(
    "text", ["", " 1", "1 ", "Gi", "1Gb", "1gi", "1.2.3", "--1", "1e", "1e+", "1Ki2", "1e1.5", "0x10", ".", "1e99999"]
)
def test_rejects_what_kubernetes_rejects(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


_digits = st.text("0123456789", min_size=1, max_size=12)
_number = st.one_of(
    _digits,
    st.tuples(_digits, _digits).map(".".join),
    _digits.map(lambda d: d + "."),
    _digits.map(lambda d: "." + d),
)
_suffix = st.one_of(
    st.sampled_from(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "", "k", "M", "G", "T", "P", "E"]),
    st.tuples(st.sampled_from("eE"), st.sampled_from(["", "+", "-"]), st.integers(0, 30)).map(
        lambda t: f"{t[0]}{t[1]}{t[2]}"
    ),
)
quantities = st.tuples(st.sampled_from(["", "+", "-"]), _number, _suffix).map("".join)


@given(quantities)
def test_every_grammatical_quantity_parses(text: str) -> None:
    parse_quantity(text)


@given(quantities)
def test_canonical_form_is_a_fixed_point(text: str) -> None:
    """canonical(parse(canonical(q))) == canonical(q), and it keeps the value to the nano."""
    quantity = parse_quantity(text)
    canonical = quantity.canonical()
    again = parse_quantity(canonical)
    assert again.canonical() == canonical
    assert again.value >= quantity.value  # Kubernetes rounds sub-nano precision up
    assert again.value - quantity.value < Fraction(1, 10**9)


@given(st.integers(-(2**70), 2**70), st.sampled_from(["BinarySI", "DecimalSI", "DecimalExponent"]))
def test_whole_numbers_round_trip_exactly(value: int, fmt: str) -> None:
    quantity = Quantity(Fraction(value), fmt)  # type: ignore[arg-type]
    assert parse_quantity(quantity.canonical()).value == value
