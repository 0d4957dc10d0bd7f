"""Durations and sizes as the planner prints them (its explanations and a block plan's summary)."""

from __future__ import annotations


def seconds(value: float) -> str:
    """A duration in the unit that keeps it readable: ``2.500 s``, ``12.0 ms``, ``40.0 us``.

    >>> seconds(2.5), seconds(0.012), seconds(-4e-5)
    ('2.500 s', '12.00 ms', '-40.0 us')
    """
    size = abs(value)
    if size >= 1:
        return f"{value:.3f} s"
    if size >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def size(nbytes: float) -> str:
    """``69.0 GB``, ``12.5 MB``, ``3.0 KB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
