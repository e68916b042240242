"""Compose a run's config with Hydra over the :class:`TrainConfig` schema, then validate it.

``load_config`` is the one entry point: YAML files in the config dir start with
``defaults: [base_train, _self_]`` (``base_train`` is :class:`TrainConfig`, registered in
Hydra's ConfigStore), command-line overrides use Hydra's grammar (``key=value``, ``+key=value``,
``++key=value``, ``~key``), and every mistake is raised as one :class:`ConfigError` before any
work starts: unknown keys (with the closest valid keys), wrong types, impossible combinations.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, List

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

import mcore_rl
from mcore_rl.config import checks
from mcore_rl.config.checks import ConfigError
from mcore_rl.config.families import arch_errors, layout_errors, parallel_shape_errors
from mcore_rl.config.paths import file_problem, hf_checkpoint_errors, tokenizer_dir_error
from mcore_rl.config.registry import (ADVANTAGE_ESTIMATORS, ENVIRONMENTS, backend_errors,
                                      task_errors)
from mcore_rl.config.schema import CHAR_TOKENIZER, DataConfig, TrainConfig

PKG_DIR = Path(mcore_rl.__file__).resolve().parent
DEFAULT_CONFIG_DIR = PKG_DIR.parent / "configs"
CONFIG_DIR_ENV = "MCORE_RL_CONFIG_DIR"
SCHEMA_NAME = "base_train"

ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
# ${mcore_rl.pkg_dir:} -> the installed package directory, so that files shipped in the package
# (e.g. data/samples/gsm8k/train.jsonl) are found whatever the working directory.
OmegaConf.register_new_resolver("mcore_rl.pkg_dir", lambda: str(PKG_DIR), replace=True)


def _schema_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the dataclass ``cls`` (sections included) -> its type hint."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        out[prefix + name] = hint
        if dataclasses.is_dataclass(hint):
            out.update(_schema_types(hint, f"{prefix}{name}."))
    return out


SCHEMA_TYPES = _schema_types(TrainConfig)


def _optional_arg(hint: Any) -> Any:
    """``X`` for ``Optional[X]``, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


def _type_name(hint: Any) -> str:
    inner = _optional_arg(hint)
    if inner is not None:
        return f"{_type_name(inner)} or null"
    return f"{hint.__name__} section" if dataclasses.is_dataclass(hint) else hint.__name__


def _closest_keys(key: str) -> list[str]:
    """Up to 3 valid keys closest to the unknown dotted ``key``, by difflib similarity of the
    last part over the whole tree (so a key put in the wrong section is found too); when some
    of them are in the key's own section, only those (``grpo.max_step`` suggests
    ``grpo.max_steps``, not also ``ppo.max_steps``)."""
    parent, _, leaf = key.rpartition(".")

    def score(k: str) -> float:
        k_parent, _, k_leaf = k.rpartition(".")
        return difflib.SequenceMatcher(None, leaf, k_leaf).ratio() + 0.01 * (k_parent == parent)

    ranked = sorted(SCHEMA_TYPES, key=score, reverse=True)[:3]
    cutoff = max(0.75, score(ranked[0]) - 0.1)
    close = [k for k in ranked if score(k) >= cutoff]
    return [k for k in close if k.rpartition(".")[0] == parent] or close


def _unknown_key(key: str, where: str) -> str:
    hint = " or ".join(f"'{k}'" for k in _closest_keys(key))
    return f"unknown config key '{key}' ({where})" + (f"; did you mean {hint}?" if hint else "")


def _wrong_type(key: str, where: str, value: Any) -> str:
    expected = _type_name(SCHEMA_TYPES[key]) if key in SCHEMA_TYPES else "another type"
    return f"wrong type for config key '{key}' ({where}): expected {expected}, got {value!r}"


def _check_overrides(overrides: Sequence[str], config_dir: Path) -> list[str]:
    """Check each override's key and value type against the schema; all problems are raised
    together. Returns the overrides for Hydra, ``~key`` of an optional key rewritten to
    ``key=null`` (a typed config has no key removal; null is its "unset")."""
    parser, probe = OverridesParser.create(), OmegaConf.structured(TrainConfig)
    errors, out = [], []
    for line in overrides:
        where = f"from override '{line}'"
        try:
            (ov,) = parser.parse_overrides([line])
        except HydraException as e:
            errors.append(f"cannot parse override '{line}': {str(e).splitlines()[0]}")
            continue
        key = ov.key_or_group
        if (config_dir / key.replace(".", "/")).is_dir():  # a config group: Hydra's business
            out.append(line)
        elif key not in SCHEMA_TYPES:
            errors.append(_unknown_key(key, where))
        elif ov.is_sweep_override():
            errors.append(f"override '{line}' is a sweep; give one value per run")
        elif ov.is_delete():
            if _optional_arg(SCHEMA_TYPES[key]) is not None:
                out.append(f"{key}=null")
            else:
                errors.append(f"cannot remove config key '{key}' ({where}): it is a required "
                              f"{_type_name(SCHEMA_TYPES[key])}; set a value instead")
        else:
            try:
                OmegaConf.update(probe, key, ov.value(), merge=True)
                out.append(line)
            except ValidationError as e:
                errors.append(_wrong_type(e.full_key, where, e.value))
            except ConfigKeyError as e:  # a dict value with an unknown key inside
                errors.append(_unknown_key(e.full_key, where))
    if errors:
        raise ConfigError("\n".join(errors))
    return out


def _yaml_line(path: Path, key: str) -> int | None:
    """1-based line of the dotted ``key`` in the YAML file ``path``, or None if not found."""
    try:
        node = yaml.compose(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for part in key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        match = next(((k, v) for k, v in node.value if k.value == part), None)
        if match is None:
            return None
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def _composition_error(e: Exception, config_name: str, config_dir: Path) -> ConfigError:
    """Translate a Hydra/OmegaConf composition error into one ConfigError naming key and file."""
    cause = e
    while cause is not None and getattr(cause, "full_key", None) is None:
        cause = cause.__cause__ or cause.__context__
    source = re.match(r"In '([^']+)'", str(e))
    if cause is None or source is None:
        return ConfigError(f"cannot compose config '{config_name}' from {config_dir}: "
                           f"{str(e).strip() or type(e).__name__}")
    path = config_dir / f"{source.group(1)}.yaml"
    line = _yaml_line(path, cause.full_key)
    where = f"in {path}" + (f", line {line}" if line else "")
    if isinstance(cause, ValidationError):
        return ConfigError(_wrong_type(cause.full_key, where, cause.value))
    return ConfigError(_unknown_key(cause.full_key, where))


def resolve_config_dir(config_dir: str | os.PathLike | None = None) -> Path:
    """The config directory: ``config_dir`` if given, else ``$MCORE_RL_CONFIG_DIR``, else the
    repository's ``configs/``. Raises ConfigError if it does not exist."""
    origin = "--config-path"
    if config_dir is None:
        config_dir, origin = os.environ.get(CONFIG_DIR_ENV), CONFIG_DIR_ENV
    if config_dir is None:
        config_dir, origin = DEFAULT_CONFIG_DIR, "the default"
    path = Path(config_dir).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"config directory {path} ({origin}) does not exist")
    return path


def load_config(config_name: str, overrides: Sequence[str] = (),
                config_dir: str | os.PathLike | None = None) -> TrainConfig:
    """Compose ``<config_dir>/<config_name>.yaml`` with Hydra over :class:`TrainConfig`, apply
    ``overrides`` (Hydra grammar), resolve interpolations and :func:`validate` the result.

    Args:
        config_name: YAML file name without ``.yaml``, e.g. ``"grpo_synthetic"``.
        overrides: e.g. ``["grpo.num_generations=4", "+model.hf_path=/m", "~checkpoint.resume"]``;
            ``~key`` sets an optional key back to null.
        config_dir: see :func:`resolve_config_dir`.

    Returns:
        The config as a typed :class:`TrainConfig` instance.

    Raises:
        ConfigError: missing config dir or file, unknown key (with the closest valid keys and
            the override or file and line it came from), wrong type, failed interpolation, or
            any violation of :func:`validate` (all reported together).
    """
    config_dir = resolve_config_dir(config_dir)
    hydra_overrides = _check_overrides(overrides, config_dir)
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=hydra_overrides)
    except MissingConfigException:
        names = ", ".join(sorted(p.stem for p in config_dir.glob("*.yaml")))
        raise ConfigError(f"config '{config_name}' not found in {config_dir} "
                          f"(available: {names or 'none'})") from None
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:
        raise _composition_error(e, config_name, config_dir) from None
    if OmegaConf.get_type(cfg) is not TrainConfig:
        raise ConfigError(f"{config_dir / config_name}.yaml must start with "
                          f"'defaults: [{SCHEMA_NAME}, _self_]'")
    try:
        train_cfg = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config key '{e.full_key}': {str(e).splitlines()[0]}") from None
    validate(train_cfg)
    return train_cfg


def validate(cfg: TrainConfig) -> None:
    """Check every key's declared choices and bounds (:mod:`mcore_rl.config.checks`, the same
    checks the components run), the files and directories the config names (data files, the
    Hugging Face checkpoint directories and their tokenizer: :mod:`mcore_rl.config.paths`), and
    the combinations that no run can satisfy (parallel layout vs model shape and workers (the
    policy's and, with ``algorithm: ppo``, the critic's), device-only features, lengths, GRPO
    and PPO batch arithmetic).

    Raises:
        ConfigError: naming every violation's keys: ``invalid config: <problem>`` for one,
            else one problem per line.
    """
    field_errors = checks.errors(cfg)
    errors = list(field_errors)

    def check(ok: bool, message: str) -> None:
        if not ok:
            errors.append(message)

    arch, device = cfg.model.arch, cfg.cluster.device
    if cfg.model.hf_path is None:  # arch_errors repeats the field checks of model.arch
        errors += [e for e in arch_errors(arch) if e not in field_errors]
    heads_ok = arch.num_query_groups >= 1 and arch.num_attention_heads >= 1
    if heads_ok:
        check(arch.num_attention_heads % arch.num_query_groups == 0,
              f"model.arch.num_attention_heads ({arch.num_attention_heads}) must be divisible by "
              f"model.arch.num_query_groups ({arch.num_query_groups})")
        check(arch.head_dim is not None or arch.hidden_size % arch.num_attention_heads == 0,
              f"model.arch.hidden_size ({arch.hidden_size}) must be divisible by "
              f"model.arch.num_attention_heads ({arch.num_attention_heads})")
    # The PPO critic has a Megatron layout of its own over cluster.num_workers processes.
    for section in ("policy", "value") if cfg.algorithm == "ppo" else ("policy",):
        mg = getattr(cfg, section).megatron
        ddp, key = mg.ddp, f"{section}.megatron"
        tp, pp, vpp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, \
            mg.virtual_pipeline_model_parallel_size
        if tp >= 1 and pp >= 1:
            check(cfg.cluster.num_workers % (tp * pp) == 0,
                  f"cluster.num_workers ({cfg.cluster.num_workers}) must be divisible by "
                  f"{key}.tensor_model_parallel_size x pipeline_model_parallel_size "
                  f"({tp} x {pp})")
        if vpp is not None and vpp >= 1:  # < 1: the field check reports it
            check(pp > 1, f"{key}.virtual_pipeline_model_parallel_size ({vpp}) needs "
                          f"{key}.pipeline_model_parallel_size > 1 (got {pp})")
        # With model.hf_path the shape is the checkpoint's: the trainer checks it when it reads
        # config.json (model.arch is unused then).
        if cfg.model.hf_path is None and (vpp is None or vpp >= 1):
            errors += parallel_shape_errors(arch, mg, key)
        if getattr(cfg, section).sequence_packing:
            # Packed micro-batches differ in length, and the pipeline schedules need one shape
            # per micro-batch: packing is refused with PP > 1 rather than padded to the budget.
            check(pp == 1 and vpp is None,
                  f"{section}.sequence_packing needs {key}.pipeline_model_parallel_size=1 and no "
                  f"virtual stages (got PP={pp}, VPP={vpp}): packed micro-batches vary in length")
            check(mg.layer_spec != "local",
                  f"{section}.sequence_packing needs {key}.layer_spec torch or transformer_engine "
                  f"(the local spec's attention has no packed-sequence (THD) path)")
            check(arch.num_experts is None,
                  f"{section}.sequence_packing does not support mixture-of-experts models yet "
                  f"(model.arch.num_experts is {arch.num_experts})")
        check(not mg.sequence_parallel or tp > 1, f"{key}.sequence_parallel needs "
              f"{key}.tensor_model_parallel_size > 1 (got {tp})")
        check(not mg.compile_layers or device != "cpu",
              f"{key}.compile_layers needs a GPU: cluster.device is 'cpu'")
        check(not ddp.overlap_param_gather or ddp.use_distributed_optimizer,
              f"{key}.ddp.overlap_param_gather needs {key}.ddp.use_distributed_optimizer")
        check(not ddp.average_in_collective,
              f"{key}.ddp.average_in_collective must be false: the losses are normalized by the "
              f"global token/sequence count (Megatron's calculate_per_token_loss), which "
              f"Megatron's DDP refuses to combine with averaging over DP")
        if cfg.model.hf_path is None:  # else the model's shape is read from the checkpoint
            errors += [e for e in layout_errors(arch, mg, key, cfg.cluster.num_workers)
                       if e not in field_errors]
        gpu_only = [n for n in ("use_distributed_optimizer", "overlap_param_gather") if getattr(ddp, n)]
        if gpu_only and (device == "cpu" or device == "auto" and not _cuda_available()):
            seen = " and torch sees no GPU" if device == "auto" else ""
            errors += [f"{key}.ddp.{n} needs a GPU: cluster.device is '{device}'{seen}"
                       for n in gpu_only]

    gen, data, grpo = cfg.generation, cfg.data, cfg.grpo
    errors += backend_errors(cfg)
    errors += algorithm_errors(cfg)
    check(data.max_prompt_length + gen.max_new_tokens <= data.max_total_length,
          f"data.max_prompt_length + generation.max_new_tokens ({data.max_prompt_length} + "
          f"{gen.max_new_tokens}) must be <= data.max_total_length ({data.max_total_length})")
    budget, mg = cfg.policy.max_tokens_per_microbatch, cfg.policy.megatron
    tp = max(1, mg.tensor_model_parallel_size) if mg.sequence_parallel else 1
    longest = -(-data.max_total_length // tp) * tp  # sequence parallelism pads widths to TP
    check(budget is None or budget >= longest,
          f"policy.max_tokens_per_microbatch ({budget}) must be null or >= data.max_total_length "
          f"({data.max_total_length}{f', rounded up to a multiple of TP={tp}' if tp > 1 else ''})"
          f": a micro-batch holds at least one whole sequence")
    check(not cfg.logging.wandb or importlib.util.find_spec("wandb") is not None,
          "logging.wandb=true needs the wandb package: pip install wandb")
    errors += task_errors(data)
    model = cfg.model
    if model.hf_path is not None:
        errors += hf_checkpoint_errors("model.hf_path", model.hf_path,
                                       tokenizer=model.tokenizer is None)
    if cfg.algorithm == "ppo" and cfg.value.hf_path is not None:
        errors += hf_checkpoint_errors("value.hf_path", cfg.value.hf_path)
    if model.tokenizer not in (None, CHAR_TOKENIZER):
        errors += filter(None, [tokenizer_dir_error("model.tokenizer", model.tokenizer)])
    errors += streaming_errors(cfg)
    errors += env_errors(cfg)
    env = cfg.env
    check(any(e.startswith("env.") for e in field_errors)  # then the field checks report it
          or env.step_timeout_seconds > env.tool_timeout_seconds,
          f"env.step_timeout_seconds ({env.step_timeout_seconds}) must be > "
          f"env.tool_timeout_seconds ({env.tool_timeout_seconds}): a step waits for its tools")
    rollouts = grpo.num_prompts_per_step * grpo.num_generations
    check(grpo.optimizer_steps_per_rollout < 1 or rollouts % grpo.optimizer_steps_per_rollout == 0,
          f"grpo.num_prompts_per_step x grpo.num_generations ({grpo.num_prompts_per_step} x "
          f"{grpo.num_generations} = {rollouts}) must be divisible by "
          f"grpo.optimizer_steps_per_rollout ({grpo.optimizer_steps_per_rollout})")
    ppo = cfg.ppo
    samples = ppo.num_prompts_per_step * ppo.num_generations
    check(ppo.num_mini_batches < 1 or samples % ppo.num_mini_batches == 0,
          f"ppo.num_prompts_per_step x ppo.num_generations ({ppo.num_prompts_per_step} x "
          f"{ppo.num_generations} = {samples}) must be divisible by ppo.num_mini_batches "
          f"({ppo.num_mini_batches})")
    if len(errors) == 1:
        raise ConfigError(f"invalid config: {errors[0]}")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def streaming_errors(cfg: TrainConfig) -> List[str]:
    """Why the streaming loop (``<algorithm>.streaming=true``,
    :mod:`mcore_rl.controller.streaming`) cannot run ``cfg``, one message per reason naming
    its keys; empty when it can or when the run does not stream. The loop trains each prompt
    group as soon as it is scored, in one optimizer step per RL step, while the rollout engine
    generates the rest in processes of its own, so it refuses what needs the whole batch before
    any of it trains: GRPO's batch-wide estimator (REINFORCE++), dynamic sampling and several
    optimizer steps a rollout; PPO's advantage whitening (the batch's mean and std),
    several epochs and several mini-batches."""
    if not cfg.streaming:
        return []
    loop, name = cfg.loop, cfg.algorithm
    on = f"{name}.streaming=true"
    errors = []
    one_step = "a streamed RL step is one optimizer step on rows that train as they arrive"
    if name == "grpo":
        if loop.optimizer_steps_per_rollout != 1:
            errors.append(f"{on} needs grpo.optimizer_steps_per_rollout=1 (got "
                          f"{loop.optimizer_steps_per_rollout}): {one_step}")
        estimator = ADVANTAGE_ESTIMATORS.get(loop.advantage_estimator)
        if estimator is not None and not estimator.per_group:
            per_group = " or ".join(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.per_group)
            errors.append(f"{on} needs a per-group grpo.advantage_estimator ({per_group}; got "
                          f"{loop.advantage_estimator}): a group trains as soon as it is scored")
        if loop.dynamic_sampling:
            errors.append(f"{on} cannot use grpo.dynamic_sampling (it draws prompt groups in "
                          f"rounds until the batch is full); the streaming loop trains each "
                          f"group as it comes")
    else:
        for key in ("ppo_epochs", "num_mini_batches"):
            if getattr(loop, key) != 1:
                errors.append(f"{on} needs ppo.{key}=1 (got {getattr(loop, key)}): {one_step}")
        if loop.whiten_advantages:
            errors.append(f"{on} needs ppo.whiten_advantages=false: whitening takes the mean and "
                          f"std of the whole batch's advantages, which are not known before its "
                          f"first rows train")
    return errors


def env_errors(cfg: TrainConfig) -> List[str]:
    """Why the multi-turn rollout loop (``env.name`` other than ``single_turn``,
    :mod:`mcore_rl.rollout.multi_turn`) cannot run ``cfg``, one message each naming its keys;
    empty for ``single_turn`` (today's one-turn path). A multi-turn environment needs the
    synchronous loop (the streaming loop decodes one turn per prompt group), and with a
    tokenizer of a pretrained model (``model.hf_path`` or ``model.tokenizer``) the chat
    template (``data.use_chat_template=true``: tool results are chat messages); the built-in
    character tokenizer renders turns as plain text."""
    env = cfg.env
    errors = []
    m = cfg.model
    pretrained = m.tokenizer not in (None, CHAR_TOKENIZER) or (m.tokenizer is None
                                                               and m.hf_path is not None)
    if cfg.data.task == "synthetic" and cfg.data.synthetic.tool_solutions > 0 and (
            env.name != "tool_use" or pretrained):
        errors.append(f"data.synthetic.tool_solutions={cfg.data.synthetic.tool_solutions} "
                      f"writes plain-text calculator episodes: it needs env.name=tool_use (got "
                      f"{env.name}) and the character tokenizer (model.tokenizer=char, or no "
                      f"model.hf_path)")
    if env.name == "single_turn" or env.name not in ENVIRONMENTS:
        return errors  # an unknown name is the field check's
    if cfg.streaming:
        errors.append(f"env.name={env.name} (a multi-turn environment) cannot run with "
                      f"{cfg.algorithm}.streaming=true: the streaming loop decodes one turn per "
                      f"prompt group; set {cfg.algorithm}.streaming=false or env.name=single_turn")
    if pretrained and not cfg.data.use_chat_template:
        errors.append(f"env.name={env.name} with a pretrained tokenizer (model.hf_path / "
                      f"model.tokenizer) needs data.use_chat_template=true: the episode's tool "
                      f"results and turns are rendered by the chat template")
    return errors


def algorithm_errors(cfg: TrainConfig) -> List[str]:
    """Combinations of ``loss.*`` and ``grpo.*`` keys no run can use, one message each naming
    its keys: a reward KL without an estimator that reads it
    (:attr:`~mcore_rl.config.registry.Estimator.reads_reward_kl`), an overlong buffer longer
    than the response budget."""
    g, out = cfg.grpo, []
    estimator = ADVANTAGE_ESTIMATORS.get(g.advantage_estimator)
    if (cfg.algorithm == "grpo" and g.reward_kl_coef > 0 and estimator is not None
            and not estimator.reads_reward_kl):
        readers = " or ".join(f"grpo.advantage_estimator={n}"
                              for n, e in ADVANTAGE_ESTIMATORS.items() if e.reads_reward_kl)
        out.append(f"grpo.reward_kl_coef ({g.reward_kl_coef}) is read by {readers} only (got "
                   f"{g.advantage_estimator!r}); use loss.kl_coef for a KL term in the loss")
    if g.overlong_buffer_length > cfg.generation.max_new_tokens:
        out.append(f"grpo.overlong_buffer_length ({g.overlong_buffer_length}) must be <= "
                   f"generation.max_new_tokens ({cfg.generation.max_new_tokens})")
    return out


def _cuda_available() -> bool:
    import torch  # deferred: only configs that ask for GPU-only features pay for the import

    return torch.cuda.is_available()
