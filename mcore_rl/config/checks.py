"""Valid values of config keys, declared once on the schema's fields and checked by everyone.

A field of :mod:`mcore_rl.config.schema` declares its choices with :func:`one_of` or its numeric
range with :func:`bounded` (stored in the dataclass field's metadata). The config loader
(:func:`mcore_rl.config.loader.validate`), the components that take a config section
(``ClippedPGLoss(cfg.loss)``, the rollout samplers, GAE, ...) and the reference page
(``docs/config-reference.md``) all read that declaration through this module, so a bound is
written once and a bad value fails at load time with the same message a component would give:
``loss.kl_coef must be >= 0 (got -1.0)``.

Errors are :class:`ConfigError`, the one type of user error: the CLI prints its message as one
line per problem and exits with status 2, without a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Callable, List, Optional, Sequence

CHOICES = "choices"  # field metadata key: tuple of the valid strings
RANGE = "range"      # field metadata key: a Range


class ConfigError(ValueError):
    """Bad user input: a config value, or a file or directory that a config key names (data
    file, model directory, checkpoint). The message names the key and, for a file, the path
    and line; one line per problem."""


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


def bounded(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None,
            le: Optional[float] = None, lt: Optional[float] = None) -> Any:
    """A dataclass field with ``default`` whose value must be ``>= ge`` (or ``> gt``) and
    ``<= le`` (or ``< lt``); null stays valid for an ``Optional`` field (it means "off")."""
    if ge is not None and gt is not None or le is not None and lt is not None:
        raise TypeError("bounded: give at most one of ge/gt and one of le/lt")
    low, high = (gt if ge is None else ge), (lt if le is None else le)
    return dataclasses.field(default=default, metadata={
        RANGE: Range(low, high, low_open=gt is not None, high_open=lt is not None)})


@functools.cache
def _optional_fields(cls: type) -> frozenset:
    """Names of the fields of dataclass ``cls`` typed ``Optional[...]``."""
    out = set()
    for name, hint in typing.get_type_hints(cls).items():
        if (typing.get_origin(hint) in (typing.Union, types.UnionType)
                and type(None) in typing.get_args(hint)):
            out.add(name)
    return frozenset(out)


def describe(cls: type, name: str, quote: Callable[[str], str] = str) -> str:
    """The valid values of field ``name`` of the config dataclass ``cls`` as errors and the
    reference page say them: ``one of hf, megatron``, ``>= 1``, ``null or > 1``, each value or
    range passed through ``quote`` (the page puts them in code spans); empty when the field
    declares none."""
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == name)
    if CHOICES in meta:
        text = "one of " + ", ".join(quote(c) for c in meta[CHOICES])
    elif RANGE in meta:
        text = quote(str(meta[RANGE]))
    else:
        return ""
    return f"null or {text}" if name in _optional_fields(cls) else text


def _field_error(cls: type, f: dataclasses.Field, value: Any, key: str) -> Optional[str]:
    if value is None and f.name in _optional_fields(cls):
        return None
    if CHOICES in f.metadata:
        ok = value in f.metadata[CHOICES]
    elif RANGE in f.metadata:
        ok = isinstance(value, (int, float)) and value in f.metadata[RANGE]
    else:
        return None
    return None if ok else f"{key} must be {describe(cls, f.name)} (got {value!r})"


def errors(section: Any, key: str = "") -> List[str]:
    """Every value of the config dataclass instance ``section`` (nested sections included)
    outside its declared choices or range, one message each, naming its dotted key under
    ``key`` (``""`` for the root :class:`~mcore_rl.config.schema.TrainConfig`)."""
    out = []
    for f in dataclasses.fields(section):
        value, dotted = getattr(section, f.name), f"{key}.{f.name}" if key else f.name
        if dataclasses.is_dataclass(value):
            out += errors(value, dotted)
        else:
            message = _field_error(type(section), f, value, dotted)
            if message:
                out.append(message)
    return out


def check(section: Any, key: str) -> None:
    """Raise :class:`ConfigError` (all problems, ``"; "``-joined) when :func:`errors` finds
    any: what a component that takes the config section at ``key`` (e.g. ``"loss"`` for
    :class:`~mcore_rl.config.schema.LossConfig`) calls at construction."""
    problems = errors(section, key)
    if problems:
        raise ConfigError("; ".join(problems))


def check_value(key: str, value: Any) -> None:
    """Raise :class:`ConfigError` when ``value`` is outside what the schema declares for the
    dotted ``key`` (e.g. ``check_value("ppo.gamma", gamma)``): for functions that take one
    config value rather than its section."""
    message = _field_error(*_field_at(key), value, key)
    if message:
        raise ConfigError(message)


@functools.cache
def _field_at(key: str) -> tuple:
    """``(dataclass, field)`` of the dotted ``key`` in the schema's ``TrainConfig``."""
    from mcore_rl.config.schema import TrainConfig  # the schema imports this module

    *parents, name = key.split(".")
    cls = functools.reduce(lambda c, part: typing.get_type_hints(c)[part], parents, TrainConfig)
    return cls, next(f for f in dataclasses.fields(cls) if f.name == name)
