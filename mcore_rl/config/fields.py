"""How the schema declares a key's valid values: :func:`one_of` (choices), :func:`plugin` (a
plugin table's names or a ``"module:attribute"`` import path) and :func:`bounded` (a numeric
:class:`Range`), stored in the dataclass field's metadata under :data:`CHOICES`, :data:`PLUGIN`
and :data:`RANGE`. :mod:`mcore_rl.config.checks` reads them (load-time checks, the components'
checks, the reference page); this module imports nothing, so :mod:`mcore_rl.config.schema` can
use it while :mod:`~mcore_rl.config.checks` imports the schema."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

CHOICES = "choices"  # field metadata key: tuple of the valid strings
RANGE = "range"      # field metadata key: a Range
PLUGIN = "plugin"    # field metadata key: True when an import path is valid beside the choices


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric interval; a side that is None is unbounded, an open side excludes its end."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        """``>= 1``, ``> 0``, ``<= 1``, ``in [0, 1)``."""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, "
                f"{self.high:g}{')' if self.high_open else ']'}")


def one_of(default: Optional[str], choices: Sequence[str]) -> Any:
    """A dataclass field with ``default`` whose value must be one of ``choices``."""
    return dataclasses.field(default=default, metadata={CHOICES: tuple(choices)})


def plugin(default: Any, choices: Sequence[str]) -> Any:
    """A dataclass field with ``default`` whose value (or, for a list, each of its values) must
    be one of ``choices`` (a plugin table's names, :mod:`mcore_rl.config.registry`) or a
    ``"module:attribute"`` import path of the user's own plugin: the key of a plugin table
    (``docs/design.md``, "Plugin tables"); :mod:`mcore_rl.config.plugins` checks the path's
    import and contract at load."""
    return dataclasses.field(default=default, metadata={CHOICES: tuple(choices), PLUGIN: True})


def bounded(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None,
            le: Optional[float] = None, lt: Optional[float] = None) -> Any:
    """A dataclass field with ``default`` whose value must be ``>= ge`` (or ``> gt``) and
    ``<= le`` (or ``< lt``); null stays valid for an ``Optional`` field (it means "off")."""
    if ge is not None and gt is not None or le is not None and lt is not None:
        raise TypeError("bounded: give at most one of ge/gt and one of le/lt")
    low, high = (gt if ge is None else ge), (lt if le is None else le)
    return dataclasses.field(default=default, metadata={
        RANGE: Range(low, high, low_open=gt is not None, high_open=lt is not None)})
