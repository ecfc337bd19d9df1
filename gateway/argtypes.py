"""The value types of the command line's flags: each parses one argument or says, in
argparse's words, why it cannot (`argparse.ArgumentTypeError`), so a bad flag is refused before
anything starts.
"""

from __future__ import annotations

import argparse
import math


def probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a probability in [0, 1]")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a count >= 0")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def status(text: str) -> int:
    value = int(text)
    if not 400 <= value <= 599:
        raise argparse.ArgumentTypeError(f"{text} is not an error status (400-599)")
    return value
