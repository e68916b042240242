"""The floor plan of ``mcore_rl``: which floor each package (or top-level module) is on.

A module may import from its own floor and the floors below it, never from a floor above, and
the import graph has no cycle, between files or between packages (a package may import a
package of its own floor only where that makes no cycle). Every import counts: module-level,
function-level, ``TYPE_CHECKING`` and ``importlib.import_module`` ones alike. A plugin table
may name a module of a higher floor as a ``"module:attribute"`` string (resolved with
``importlib`` where the plugin is used); only the modules in :data:`PLUGIN_TABLES` may. ``tests/test_imports.py`` checks all of
this on every module with :mod:`ast`, and that ``docs/design.md`` draws the plan of
:func:`floor_plan` (the README links it); ``docs/design.md`` ("Floor plan") says why each floor is where it is.

This module is data: nothing in the package imports it.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Tuple


class Floor(NamedTuple):
    """One floor: its packages (subpackages of ``mcore_rl`` or top-level modules, by name) and
    what lives there."""

    name: str
    packages: Tuple[str, ...]
    holds: str


# Bottom first. "mcore_rl" is the package root (mcore_rl/__init__.py: the version only).
FLOORS: Tuple[Floor, ...] = (
    Floor("config", ("mcore_rl", "config", "utils"),
          "schema, checks, Hydra loading, plugin tables; run logging, timers"),
    Floor("data", ("data", "rewards"),
          "batch conventions, prompt tasks, tokenizers, micro-batches; verifiers"),
    Floor("algorithms & megatron", ("algorithms", "megatron"),
          "losses, advantages, KL; Megatron model, parallel state, conversion, KV-cache attention"),
    Floor("workers", ("workers",),
          "MegatronTrainWorker, PolicyWorker, ValueWorker, their typed interfaces"),
    Floor("distributed", ("distributed",),
          "worker groups (Ray actors or processes), placement"),
    Floor("generation", ("generation",),
          "rollout engines behind one interface: hf, megatron, vllm"),
    Floor("environments & rollout", ("environments", "rollout"),
          "environments (reset/step, tools, sandbox, executor); the multi-turn loop, the rollout producer"),
    Floor("controller", ("controller",),
          "the RL loops (sync, streaming), GRPO/PPO strategies, checkpoints, colocation"),
    Floor("entry points", ("cli", "__main__", "export", "gguf", "planning", "layers"),
          "the mcore-rl command, Hugging Face export, GGUF import, the memory planner, this plan"),
)

# Packages of the plan not built yet: no module of theirs is required to exist.
PLANNED = frozenset()

# Modules that may name modules of higher floors as "module:attribute" strings (plugin tables).
PLUGIN_TABLES = frozenset({"mcore_rl.config.registry"})


def floor_of() -> Dict[str, int]:
    """Package name -> its floor's index in :data:`FLOORS` (0: the bottom)."""
    return {package: i for i, floor in enumerate(FLOORS) for package in floor.packages}


def floor_plan() -> str:
    """The plan as the text block ``docs/design.md`` shows: top floor first, one line per
    floor."""
    width = max(len(", ".join(f.packages)) for f in FLOORS)
    lines = [f"{i}  {', '.join(f.packages):<{width}}  {f.holds}"
             for i, f in reversed(list(enumerate(FLOORS)))]
    return "\n".join(lines)
