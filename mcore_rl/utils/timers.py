"""Wall-clock timing of the phases of a step."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Iterator


class PhaseTimer:
    """Accumulates seconds per named phase; :meth:`pop` returns and clears them as
    ``{"timing/<phase>_s": seconds}``."""

    def __init__(self) -> None:
        self._seconds: Dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def pop(self) -> Dict[str, float]:
        out = {f"timing/{k}_s": v for k, v in self._seconds.items()}
        self._seconds.clear()
        return out
