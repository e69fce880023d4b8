"""Kubernetes resource quantities (`100m`, `2`, `1.5Gi`, `128974848`, `129e6`, `123Mi`, `1k`) as
exact numbers, following apimachinery's resource.Quantity grammar."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from fsdpkit.errors import UserError

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
            "P": Decimal("1e15"), "E": Decimal("1e18")}
_FORM = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")


def parse(value: str | int | float) -> Decimal:
    """The quantity as a Decimal in base units (cores, bytes, devices)."""
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    m = _FORM.match(str(value).strip())
    if not m:
        raise UserError(f"{value!r} is not a Kubernetes quantity")
    number, exponent, suffix = m.groups()
    try:
        base = Decimal(number)
    except InvalidOperation:
        raise UserError(f"{value!r} is not a Kubernetes quantity") from None
    if exponent:
        return base * Decimal(10) ** int(exponent[1:])
    if suffix in _BINARY:
        return base * _BINARY[suffix]
    return base * _DECIMAL[suffix or ""]


def fmt_bytes(n: Decimal | int) -> str:
    """Bytes for people: 1.5 GiB, 768 MiB."""
    n = Decimal(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}".replace(".0 ", " ")
    return f"{int(n)} B"


def fmt_cores(n: Decimal) -> str:
    return f"{n:.3f}".rstrip("0").rstrip(".")
