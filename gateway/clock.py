"""The clock the shells read. Pure modules take `now` as a parameter instead."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def __call__(self) -> float:
        """Monotonic seconds."""
        ...


monotonic: Clock = time.monotonic
