"""The plugin tables: every name a config key chooses, and where its implementation lives.

A plugin (an RL algorithm, a policy loss, an advantage estimator, a generation backend, a
prompt task, a verifier, a learned reward, an environment) is a module
on its own floor of the package (``docs/design.md``, "Floor plan"); its entry here names it as
``"module:attribute"`` strings. So the config floor knows the valid names (the schema's choices,
the error messages, ``docs/config-reference.md``) and runs each chosen plugin's load-time check
(:func:`backend_errors`, :func:`task_errors`: from the rules of :mod:`mcore_rl.config.rules`
that :func:`mcore_rl.config.loader.validate` runs)
without importing anything above it; the floors that use a plugin resolve its entry with :func:`load`
(:mod:`mcore_rl.algorithms.registry`, :mod:`mcore_rl.generation.registry`,
:func:`mcore_rl.data.prompts.load_task`). Adding one is its module plus one line here.

A user's own reward, environment, prompt task, advantage estimator or policy loss needs no line
here: the key (declared with :func:`~mcore_rl.config.fields.plugin`) also takes a
``"module:attribute"`` import path (:func:`is_import_path`; ``reward.name=my_pkg.rewards:score``),
resolved by :func:`path_of` / :func:`task_entry` / :func:`estimator_entry` and checked against
the plugin's contract at load (:mod:`mcore_rl.config.plugins`).

This module imports nothing of the package; an entry's module is imported when the entry is
used, and a load-time check lives in a module that imports without torch (loading a config
stays fast).
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple


class Estimator(NamedTuple):
    """An advantage estimator (``grpo.advantage_estimator``).

    Attributes:
        fn: ``"module:function"`` mapping ``(rollout, TrainConfig)`` to ``[B, S]`` float32
            advantages (:mod:`mcore_rl.algorithms.estimators`).
        per_group: each prompt group's advantages come from that group's rows alone, so the
            streaming loop can train a group as soon as it is scored.
        reads_reward_kl: reads ``grpo.reward_kl_coef`` (the KL term in the reward).
    """

    fn: str
    per_group: bool
    reads_reward_kl: bool = False


class BackendEntry(NamedTuple):
    """A generation backend (``generation.backend``).

    Attributes:
        cls: ``"module:class"`` of the :class:`~mcore_rl.generation.base.GenerationBackend`
            subclass.
        config_check: None, or ``"module:function"`` mapping ``TrainConfig`` to the reasons
            (``List[str]``, each naming its keys) the config cannot run this backend, in a
            module that imports without torch (:mod:`mcore_rl.generation.checks`).
    """

    cls: str
    config_check: Optional[str] = None


class Task(NamedTuple):
    """A prompt task (``data.task``).

    Attributes:
        examples: ``"module:function"`` mapping ``(DataConfig, seed)`` to ``(train, test)``
            lists of :class:`~mcore_rl.data.example.Example` (test empty: no validation set).
        config_check: ``"module:function"`` mapping ``DataConfig`` to the reasons
            (``List[str]``, each naming its ``data.*`` keys) the task cannot load its prompts
            from it, torch-free; None: no check (a user's task given by its import path).
    """

    examples: str
    config_check: Optional[str] = None


# algorithm -> "module:class" of an RL algorithm (mcore_rl/controller/algorithm.py: the
# Algorithm protocol the loops call), built with (TrainConfig); its name is also its config
# section. Built by mcore_rl.controller.loops.build.
ALGORITHMS: Dict[str, str] = {
    "grpo": "mcore_rl.controller.grpo:GRPO",
    "ppo": "mcore_rl.controller.ppo:PPO",
    "rm": "mcore_rl.controller.rm:RewardModelTraining",
}

# loss.name -> "module:class"; the class takes (LossConfig, max_response_length) and has
# ClippedPGLoss's interface (loss_type, metric_kinds, __call__).
POLICY_LOSSES: Dict[str, str] = {
    "ppo_clip": "mcore_rl.algorithms.losses:ClippedPGLoss",
    "gspo": "mcore_rl.algorithms.losses:GSPOLoss",
}

# grpo.advantage_estimator -> its estimator.
ADVANTAGE_ESTIMATORS: Dict[str, Estimator] = {
    "grpo": Estimator("mcore_rl.algorithms.estimators:grpo", per_group=True),
    "rloo": Estimator("mcore_rl.algorithms.estimators:rloo", per_group=True),
    "reinforce_plus_plus": Estimator("mcore_rl.algorithms.estimators:reinforce_plus_plus",
                                     per_group=False, reads_reward_kl=True),
}

# generation.backend -> its backend.
BACKENDS: Dict[str, BackendEntry] = {
    "hf": BackendEntry("mcore_rl.generation.hf:HFGenerationBackend",
                       "mcore_rl.generation.checks:hf_config_errors"),
    "megatron": BackendEntry("mcore_rl.generation.megatron:MegatronGenerationBackend",
                             "mcore_rl.generation.checks:megatron_config_errors"),
    "vllm": BackendEntry("mcore_rl.generation.vllm:VLLMGenerationBackend",
                         "mcore_rl.generation.checks:vllm_config_errors"),
}

# data.task -> its task (the first is the schema's default).
TASKS: Dict[str, Task] = {
    "synthetic": Task("mcore_rl.data.synthetic:task_examples", "mcore_rl.data.synthetic:task_errors"),
    "gsm8k": Task("mcore_rl.data.gsm8k:task_examples", "mcore_rl.data.gsm8k:task_errors"),
    "dataset": Task("mcore_rl.data.dataset:task_examples", "mcore_rl.data.dataset:task_errors"),
}

# reward.name -> "module:function" of its verifier, ``(response_text, Example) -> float``
# (mcore_rl/rewards/: exact integer answers, math answers through math-verify).
VERIFIERS: Dict[str, str] = {
    "exact": "mcore_rl.rewards.exact:exact_reward",
    "math": "mcore_rl.rewards.math:math_reward",
}

# reward.name -> "module:class" of a learned reward (mcore_rl/controller/learned_rewards.py:
# a model that scores whole rollouts, a float per sample), built with (TrainConfig, the
# policy's tokenizer) before any worker starts (it reads and checks its inputs), then started
# on the run's placement. Its load-time checks: mcore_rl/config/learned.py.
LEARNED_REWARDS: Dict[str, str] = {
    "model": "mcore_rl.controller.learned_rewards:RewardModelReward",
    "judge": "mcore_rl.controller.learned_rewards:JudgeReward",
}


# env.name -> "module:class" of an environment (mcore_rl/environments/base.py: reset(example),
# step(state, model_turn_text)) with a classmethod from_config(TrainConfig); the first is the
# schema's default. Built by mcore_rl.environments.build_environment.
ENVIRONMENTS: Dict[str, str] = {
    "single_turn": "mcore_rl.environments.single_turn:SingleTurnEnvironment",
    "tool_use": "mcore_rl.environments.tool_use:ToolUseEnvironment",
}

# env.sandbox -> None, or "module:function" of its load-time check, mapping TrainConfig to the
# reasons (List[str], each naming env.sandbox and the choices) the machine cannot run it, in a
# torch-free module. How the Python sandbox isolates model-written code
# (mcore_rl/environments/sandbox.py); the first is the schema's default.
SANDBOXES: Dict[str, Optional[str]] = {
    "bwrap": "mcore_rl.environments.sandbox:sandbox_config_errors",
    "unsafe_subprocess": None,
}


# "package.module:attribute" (the attribute may be dotted: "module:Class.method").
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(value: Any) -> bool:
    """Whether ``value`` is a ``"module:attribute"`` import path (``my_pkg.rewards:score``):
    what a plugin key takes beside its table's names."""
    return isinstance(value, str) and _IMPORT_PATH.fullmatch(value) is not None


def load(path: str) -> Any:
    """The attribute ``"module:attribute"`` names (``attribute`` may be dotted), its module
    imported now.

    Raises:
        ImportError: the module does not import; AttributeError: it lacks the attribute
            (:func:`mcore_rl.config.plugins.import_plugin` turns both into one line naming
            the key).
    """
    module, _, attribute = path.partition(":")
    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def path_of(table: Dict[str, str], name: str) -> Optional[str]:
    """The ``"module:attribute"`` of ``name`` for a plugin key whose table ``table`` maps names
    to import paths (``VERIFIERS``, ``ENVIRONMENTS``, ``POLICY_LOSSES``): its entry, or
    ``name`` itself when it is an import path; None for anything else."""
    if name in table:
        return table[name]
    return name if is_import_path(name) else None


def task_entry(name: str) -> Optional[Task]:
    """The :class:`Task` of ``data.task=name``: its ``TASKS`` entry, or for an import path a
    task of that function and no config check; None for anything else."""
    if name in TASKS:
        return TASKS[name]
    return Task(name) if is_import_path(name) else None


def estimator_entry(name: str) -> Optional[Estimator]:
    """The :class:`Estimator` of ``grpo.advantage_estimator=name``: its
    ``ADVANTAGE_ESTIMATORS`` entry, or for an import path the function's own ``per_group`` and
    ``reads_reward_kl`` attributes (both False when absent: such an estimator does not stream
    and reads no reward KL); None for anything else, or an import path that does not import
    (the plugin check reports it)."""
    if name in ADVANTAGE_ESTIMATORS:
        return ADVANTAGE_ESTIMATORS[name]
    if not is_import_path(name):
        return None
    try:
        fn = load(name)
    except Exception:  # reported by mcore_rl.config.plugins, with the key
        return None
    return Estimator(name, per_group=bool(getattr(fn, "per_group", False)),
                     reads_reward_kl=bool(getattr(fn, "reads_reward_kl", False)))


def names(table: Dict[str, Any]) -> Tuple[str, ...]:
    """The valid values of the config key whose plugins ``table`` holds, in table order."""
    return tuple(table)


def task_errors(data: Any) -> List[str]:
    """Why ``data.task`` cannot load its prompts from the ``data`` section ``data``
    (:class:`~mcore_rl.config.schema.DataConfig`), one message per problem naming its keys:
    the task's own check (:attr:`Task.config_check`); empty for an unknown task (the choices
    check reports it). Checked by :func:`mcore_rl.config.rules.task_rules` (config loading) and
    :func:`mcore_rl.data.prompts.load_task`."""
    task = TASKS.get(data.task)
    return [] if task is None else load(task.config_check)(data)


def backend_errors(cfg: Any) -> List[str]:
    """Why ``cfg`` (a :class:`~mcore_rl.config.schema.TrainConfig`) cannot run its
    ``generation.backend`` (the backend's :attr:`BackendEntry.config_check`), one message per
    reason naming its keys; empty when it can, or when the name is unknown (the choices check
    reports that)."""
    entry = BACKENDS.get(cfg.generation.backend)
    if entry is None or entry.config_check is None:
        return []
    check: Callable[[Any], List[str]] = load(entry.config_check)
    return check(cfg)


def sandbox_errors(cfg: Any) -> List[str]:
    """Why this machine cannot run ``cfg``'s ``env.sandbox`` (its :data:`SANDBOXES` check), one
    message per reason; empty when it can, when the choice has no check, or when the name is
    unknown (the choices check reports that)."""
    check = SANDBOXES.get(cfg.env.sandbox)
    return [] if check is None else load(check)(cfg)
