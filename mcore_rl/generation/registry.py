"""The generation backends by name (config key ``generation.backend``), imported only when used.

A backend is a :class:`~mcore_rl.generation.base.GenerationBackend` subclass in a module of its
own; adding one is a line in :data:`BACKENDS`. The config loader takes the valid names from
:func:`backend_names` and runs the chosen backend's load-time check (:func:`config_errors`);
the controller builds it with :func:`build_backend` from a
:class:`~mcore_rl.generation.base.BackendContext`. This module imports neither torch nor any
backend at import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Dict, List, NamedTuple, Optional, Tuple, Type

if TYPE_CHECKING:
    from mcore_rl.config.schema import TrainConfig
    from mcore_rl.generation.base import BackendContext, GenerationBackend


class BackendEntry(NamedTuple):
    """Where a backend lives, as ``"module:attribute"`` paths.

    Attributes:
        cls: the :class:`~mcore_rl.generation.base.GenerationBackend` subclass.
        config_check: None, or a function ``(TrainConfig) -> List[str]`` of reasons the config
            cannot run this backend (each naming its keys), in a module that imports without
            torch (:mod:`mcore_rl.generation.checks`).
    """

    cls: str
    config_check: Optional[str] = None


BACKENDS: Dict[str, BackendEntry] = {
    "hf": BackendEntry("mcore_rl.generation.hf:HFGenerationBackend",
                       "mcore_rl.generation.checks:hf_config_errors"),
    "megatron": BackendEntry("mcore_rl.generation.megatron:MegatronGenerationBackend",
                             "mcore_rl.generation.checks:megatron_config_errors"),
    "vllm": BackendEntry("mcore_rl.generation.vllm:VLLMGenerationBackend",
                         "mcore_rl.generation.checks:vllm_config_errors"),
}


def _load(path: str):
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def backend_names() -> Tuple[str, ...]:
    """The valid values of ``generation.backend``."""
    return tuple(BACKENDS)


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
    return _load(_entry(name).cls)


def config_errors(cfg: "TrainConfig") -> List[str]:
    """Why ``cfg`` cannot run its ``generation.backend`` (the backend's load-time check), one
    message per reason; empty when it can, or when the name is unknown (the loader's choices
    check reports that)."""
    entry = BACKENDS.get(cfg.generation.backend)
    if entry is None or entry.config_check is None:
        return []
    check: Callable[["TrainConfig"], List[str]] = _load(entry.config_check)
    return check(cfg)


def build_backend(ctx: "BackendContext") -> "GenerationBackend":
    """The backend ``ctx.cfg.generation.backend``, built from ``ctx``.

    Raises:
        ValueError: an unknown name, or the backend's own (``generation.*`` values).
    """
    return backend_class(ctx.cfg.generation.backend).from_context(ctx)
