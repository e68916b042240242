"""The generation backends by name (config key ``generation.backend``), imported only when used.

A backend is a :class:`~mcore_rl.generation.base.GenerationBackend` subclass in a module of its
own; adding one is that module plus a line in the plugin table
:data:`mcore_rl.config.registry.BACKENDS` (:data:`BACKENDS` here), which names its class and its
load-time check. The schema takes the valid names from that table and the config loader runs
the chosen backend's check (:func:`mcore_rl.config.registry.backend_errors`); the controller
builds it with :func:`build_backend` from a :class:`~mcore_rl.generation.base.BackendContext`.
This module imports neither torch nor any backend at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple, Type

from mcore_rl.config import registry as tables
from mcore_rl.config.registry import BackendEntry

if TYPE_CHECKING:
    from mcore_rl.generation.base import BackendContext, GenerationBackend


# The table (name -> BackendEntry: "module:class" and the load-time check), by its name here.
BACKENDS = tables.BACKENDS


def backend_names() -> Tuple[str, ...]:
    """The valid values of ``generation.backend``."""
    return tables.names(BACKENDS)


def _entry(name: str) -> BackendEntry:
    if name not in BACKENDS:
        raise ValueError(f"generation.backend: unknown backend {name!r}; choose one of "
                         f"{', '.join(BACKENDS)}")
    return BACKENDS[name]


def backend_class(name: str) -> Type["GenerationBackend"]:
    """The class of backend ``name`` (its module imported now).

    Raises:
        ValueError: ``name`` is not in :data:`BACKENDS` (names ``generation.backend``).
    """
    return tables.load(_entry(name).cls)


def build_backend(ctx: "BackendContext") -> "GenerationBackend":
    """The backend ``ctx.cfg.generation.backend``, built from ``ctx``.

    Raises:
        ValueError: an unknown name, or the backend's own (``generation.*`` values).
    """
    return backend_class(ctx.cfg.generation.backend).from_context(ctx)
