"""Users' own plugins, by import path: a reward, an environment, a prompt task, an advantage
estimator or a policy loss of the user's module, named in the config as ``"module:attribute"``
(``reward.name=my_pkg.rewards:score``; ``docs/design.md``, "Plugin tables"), with no edit to the
package.

At load (:func:`mcore_rl.config.rules.plugin_rules`) each such value is imported
(:func:`import_plugin`) and checked against its key's contract (:data:`CONTRACTS`): the
callable's signature, a class's required methods. Every failure is one line naming the key, the
path and what is wrong (module not found, attribute missing, wrong signature):
``reward.name=my_pkg.rewards:score: score(response) cannot be called as (response_text,
example)``. The built-in names of the keys stay in their tables
(:mod:`mcore_rl.config.registry`); the floors that use a plugin resolve either form there
(:func:`~mcore_rl.config.registry.path_of`, :func:`~mcore_rl.config.registry.task_entry`,
:func:`~mcore_rl.config.registry.estimator_entry`).

This module imports nothing of the package above the config floor; the user's module is
imported when its key is checked (what it imports is the user's business).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from mcore_rl.config.registry import is_import_path


class Contract(NamedTuple):
    """What a plugin key's import path must name.

    Attributes:
        what: the plugin, as the error messages and ``docs/design.md`` say it.
        check: ``(the imported object, TrainConfig) -> None, or what is wrong`` (one line).
    """

    what: str
    check: Callable[[Any, Any], Optional[str]]


def one_line(error: BaseException) -> str:
    """``"<Type>: <message>"`` of ``error`` with its whitespace (newlines too) collapsed."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def import_plugin(path: str) -> Tuple[Any, Optional[str]]:
    """Import the attribute ``"module:attribute"`` names (``attribute`` may be dotted).

    Returns:
        ``(object, None)``, or ``(None, why)`` with ``why`` one line: the module is not found
        (on ``sys.path``: installed, or its directory on ``PYTHONPATH``), its import raised
        (the exception, e.g. a module it imports is missing), or it has no such attribute
        (with the closest names it has).
    """
    module, _, attribute = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            return None, (f"module {module!r} not found (install it, or put its directory on "
                          f"PYTHONPATH)")
        return None, f"importing module {module!r} raised {one_line(e)}"
    except Exception as e:  # the user's module: a syntax error, a failing top-level statement
        return None, f"importing module {module!r} raised {one_line(e)}"
    done: List[str] = []
    for part in attribute.split("."):
        if not hasattr(obj, part):
            where = f"module {module!r}" if not done else f"{module}:{'.'.join(done)}"
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")],
                                              n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            return None, f"{where} has no attribute {part!r}{hint}"
        obj = getattr(obj, part)
        done.append(part)
    return obj, None


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def _call_problem(fn: Any, positional: int, shape: str) -> Optional[str]:
    """None when ``fn`` can be called with ``positional`` positional arguments (or its
    signature cannot be read: a builtin), else ``"<name><signature> cannot be called as
    <shape>"``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*([None] * positional))
    except TypeError:
        return f"{_name(fn)}{signature} cannot be called as {shape}"
    return None


def _unbound(owner: Any, method: str) -> bool:
    """Whether ``owner.method`` is a plain function of a class (so ``self`` is its first
    parameter when it is read from the class)."""
    return isinstance(owner, type) and isinstance(inspect.getattr_static(owner, method, None),
                                                  types.FunctionType)


def _function_problem(shape: str, positional: int) -> Callable[[Any, Any], Optional[str]]:
    """The check of a plugin that is a function called as ``shape``."""
    def check(fn: Any, cfg: Any) -> Optional[str]:
        if isinstance(fn, type):
            return f"{_name(fn)} is a class; name a function {shape}"
        if not callable(fn):
            return f"is a {type(fn).__name__}, not a function {shape}"
        return _call_problem(fn, positional, shape)
    return check


def _reward_problem(fn: Any, cfg: Any) -> Optional[str]:
    """A reward: a function (or ``async def``, or a callable object) ``(response_text,
    example) -> float``; with ``fn.batched`` true, ``(responses, examples) -> list of
    floats``."""
    shape = ("(responses, examples) -> list of floats (batched = True)"
             if getattr(fn, "batched", False) else "(response_text, example) -> float")
    return _function_problem(shape, 2)(fn, cfg)


ENVIRONMENT_METHODS = (("from_config", 1, "from_config(cfg)"), ("reset", 1, "reset(example)"),
                       ("step", 2, "step(state, model_turn_text)"))


def _environment_problem(env: Any, cfg: Any) -> Optional[str]:
    """An environment: a class with a classmethod ``from_config(cfg)``, ``reset(example)`` and
    ``step(state, model_turn_text)`` (:mod:`mcore_rl.environments.base`)."""
    missing = [m for m, _, _ in ENVIRONMENT_METHODS if not callable(getattr(env, m, None))]
    if missing:
        return (f"{_name(env)} has no {', '.join(missing)}: an environment is a class with a "
                f"classmethod from_config(cfg), reset(example) and step(state, model_turn_text)")
    if _unbound(env, "from_config"):
        return f"{_name(env)}.from_config must be a classmethod (it builds the environment)"
    for method, positional, shape in ENVIRONMENT_METHODS:
        problem = _call_problem(getattr(env, method), positional + _unbound(env, method), shape)
        if problem:
            return problem
    return None


def _loss_problem(cls: Any, cfg: Any) -> Optional[str]:
    """A policy loss: built as ``cls(cfg.loss, max_response_length=generation.max_new_tokens)``
    (built here once, to check it), with ``loss_type`` ``"token"`` or ``"sequence"``, a dict
    ``metric_kinds`` and ``__call__(logprobs, batch)`` (ClippedPGLoss's interface)."""
    if not callable(cls):
        return f"is a {type(cls).__name__}, not a loss class"
    try:
        loss = cls(cfg.loss, max_response_length=cfg.generation.max_new_tokens)
    except Exception as e:
        return (f"{_name(cls)}(loss config, max_response_length={cfg.generation.max_new_tokens})"
                f" raised {one_line(e)}")
    loss_type = getattr(loss, "loss_type", None)
    if loss_type not in ("token", "sequence"):
        return f"{_name(cls)}.loss_type must be 'token' or 'sequence' (got {loss_type!r})"
    if not isinstance(getattr(loss, "metric_kinds", None), dict):
        return f"{_name(cls)}.metric_kinds must be a dict of metric name -> its count's kind"
    if not callable(loss):
        return f"{_name(cls)} has no __call__(logprobs, batch)"
    return _call_problem(loss, 2, "loss(logprobs, batch) -> (loss_sum, count, metrics)")


# Plugin key -> the contract of its import-path form.
CONTRACTS: Dict[str, Contract] = {
    "reward.name": Contract("a reward function", _reward_problem),
    "reward.names": Contract("a reward function", _reward_problem),
    "env.name": Contract("an environment class", _environment_problem),
    "data.task": Contract("a prompt task function",
                          _function_problem("(data_config, seed) -> (train, test)", 2)),
    "grpo.advantage_estimator": Contract("an advantage estimator function",
                                         _function_problem("(rollout, cfg) -> advantages", 2)),
    "loss.name": Contract("a policy loss class", _loss_problem),
}


def _used_values(cfg: Any, key: str) -> List[Tuple[str, str]]:
    """``(the key as errors name it, value)`` of each import path ``key`` holds in ``cfg``;
    none for ``reward.name`` when ``reward.names`` replaces it."""
    section, _, leaf = key.partition(".")
    if key == "reward.name" and cfg.reward.names is not None:
        return []
    value = getattr(getattr(cfg, section), leaf)
    if isinstance(value, (list, tuple)):
        return [(f"{key}[{i}]", v) for i, v in enumerate(value) if is_import_path(v)]
    return [(key, value)] if is_import_path(value) else []


def plugin_errors(cfg: Any) -> List[str]:
    """Why the import paths of ``cfg``'s plugin keys (:data:`CONTRACTS`) cannot be used, one
    line each: ``<key>=<path>: <what is wrong>``; empty when all import and honour their
    contracts (or none is given)."""
    out = []
    for key, contract in CONTRACTS.items():
        for name, path in _used_values(cfg, key):
            obj, problem = import_plugin(path)
            if problem is None:
                problem = contract.check(obj, cfg)
            if problem:
                out.append(f"{name}={path}: {problem}")
    return out
