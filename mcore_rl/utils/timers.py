"""Wall-clock timing of the phases of a step."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional


class PhaseTimer:
    """Accumulates seconds per named phase; :meth:`pop` returns and clears them as
    ``{"timing/<phase>_s": seconds}``.

    Args:
        watch: told of each phase's start and end: ``watch.begin(name)`` returns a token
            (None: not watched) that ``watch.end(token)`` gets back (the hang watchdog,
            :class:`mcore_rl.controller.watchdog.Watchdog`); None: nothing is told.

    :attr:`listener`, when set, is called with the innermost open phase each time one starts
    or ends inside another (the enclosing ``step`` does not count, and the last phase stays
    shown between phases): the console progress's phase
    (:meth:`mcore_rl.utils.logging.RunLogger.phase`).
    """

    def __init__(self, watch: Optional[Any] = None) -> None:
        self._seconds: Dict[str, float] = {}
        self._watch = watch
        self.listener: Optional[Callable[[Optional[str]], None]] = None
        self._open: List[str] = []

    def _tell(self) -> None:
        shown = [name for name in self._open if name != "step"]
        if self.listener is not None and shown:
            self.listener(shown[-1])

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (seconds add up over repeats until :meth:`pop`)."""
        token = self._watch.begin(name) if self._watch is not None else None
        self._open.append(name)
        self._tell()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start
            if token is not None:
                self._watch.end(token)
            del self._open[len(self._open) - 1 - self._open[::-1].index(name)]
            self._tell()

    def seconds(self, name: str) -> float:
        """Seconds spent in phase ``name`` since the last :meth:`pop` (0 if none)."""
        return self._seconds.get(name, 0.0)

    def pop(self) -> Dict[str, float]:
        out = {f"timing/{k}_s": v for k, v in self._seconds.items()}
        self._seconds.clear()
        return out


def phase_table(seconds_per_step: Dict[str, float]) -> str:
    """A plain-text table of the per-phase breakdown of an RL step.

    Args:
        seconds_per_step: mean wall seconds per RL step by phase name, as in a run's
            ``summary.json`` (``seconds_per_step``). ``step`` is the whole RL step; the other
            phases nest in it (``generation``, ``logprobs``, ``train``, ...), except
            ``validation``, which runs after it on validation steps (averaged over all steps).

    Returns:
        One line per phase, longest first: seconds per step and share of the step. Phases that
        nest in others (``train`` within ``train_critic`` ...) are listed as measured, so the
        shares need not add up to 100%.
    """
    step = seconds_per_step.get("step", 0.0)
    lines = ["per-phase time (mean seconds per RL step, share of the step):"]
    for name, sec in sorted(seconds_per_step.items(), key=lambda kv: -kv[1]):
        share = f"{100 * sec / step:5.1f}%" if step > 0 and name != "step" else ""
        lines.append(f"  {name:<14} {sec:9.4f} s  {share}")
    return "\n".join(lines)
