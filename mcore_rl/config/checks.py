"""Valid values of config keys, declared once on the schema's fields and checked by everyone.

A field of :mod:`mcore_rl.config.schema` declares its choices with :func:`one_of` or its numeric
range with :func:`bounded` (:mod:`mcore_rl.config.fields`, stored in the dataclass field's
metadata). The config loader
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
from typing import Any, Callable, List, Optional

# The declarations (mcore_rl.config.fields), re-exported: this module is what everyone reads.
from mcore_rl.config.fields import CHOICES, PLUGIN, RANGE, Range, bounded, one_of  # noqa: F401
from mcore_rl.config.registry import is_import_path
from mcore_rl.config.schema import TrainConfig

# How errors and the reference page name the import-path form of a plugin key.
IMPORT_PATH_FORM = '"module:attribute"'


class ConfigError(ValueError):
    """Bad user input: a config value, or a file or directory that a config key names (data
    file, model directory, checkpoint). The message names the key and, for a file, the path
    and line; one line per problem."""


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
    reference page say them: ``one of hf, megatron``, ``>= 1``, ``null or > 1``, a plugin key's
    ``one of exact, math, or "module:attribute"`` (``each one of ...`` for a list), each value or
    range passed through ``quote`` (the page puts them in code spans); empty when the field
    declares none."""
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == name)
    if CHOICES in meta and meta.get(PLUGIN):
        text = ("one of " + ", ".join(quote(c) for c in meta[CHOICES])
                + f", or a {quote(IMPORT_PATH_FORM)} import path")
        if _is_list(cls, name):
            text = "each " + text
    elif CHOICES in meta:
        text = "one of " + ", ".join(quote(c) for c in meta[CHOICES])
    elif RANGE in meta:
        text = quote(str(meta[RANGE]))
    else:
        return ""
    return f"null or {text}" if name in _optional_fields(cls) else text


@functools.cache
def _is_list(cls: type, name: str) -> bool:
    """Whether field ``name`` of dataclass ``cls`` is typed ``List[...]`` (or ``Optional`` of
    it)."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    return typing.get_origin(hint) is list


def _field_error(cls: type, f: dataclasses.Field, value: Any, key: str) -> Optional[str]:
    if value is None and f.name in _optional_fields(cls):
        return None
    if f.metadata.get(PLUGIN):
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in values if v not in f.metadata[CHOICES] and not is_import_path(v)]
        if not bad:
            return None
        got = repr(bad[0]) if not isinstance(value, (list, tuple)) else repr(bad)
        return f"{key} must be {describe(cls, f.name)} (got {got})"
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


def describe_key(key: str) -> str:
    """:func:`describe` of the dotted schema ``key`` (``"reward.name"``)."""
    cls, f = _field_at(key)
    return describe(cls, f.name)


@functools.cache
def _field_at(key: str) -> tuple:
    """``(dataclass, field)`` of the dotted ``key`` in the schema's ``TrainConfig``."""
    *parents, name = key.split(".")
    cls = functools.reduce(lambda c, part: typing.get_type_hints(c)[part], parents, TrainConfig)
    return cls, next(f for f in dataclasses.fields(cls) if f.name == name)
