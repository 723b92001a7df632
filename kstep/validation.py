"""Range checks for values a user sends (CLI flags, HTTP fields, Python arguments): a ValueError
that names the value and the rule, never an assert. Plain Python, no torch."""
import math


def check_int(name: str, value, low: int | None, high: int | None = None, rule: str | None = None) -> None:
    if value is None:
        return
    bad = not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low) or \
        (high is not None and value > high)
    if bad:
        rule = rule or ("an integer" if low is None else "a positive integer" if low == 1 else f"an integer >= {low}")
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def check_number(name: str, value, low: float, high: float | None = None, exclusive_low: bool = False) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (value <= low if exclusive_low else value < low) or (high is not None and value > high):
        low_text = f"> {low}" if exclusive_low else f">= {low}"
        raise ValueError(f"{name} must be {low_text}" + (f" and <= {high}" if high is not None else "") +
                         f", got {value}")
