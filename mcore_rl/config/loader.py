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
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
# Re-exported: callers import the streaming and algorithm checks from the loader.
from mcore_rl.config.rules import (algorithm_errors, env_errors, rule_errors,  # noqa: F401
                                   streaming_errors)
from mcore_rl.config.schema import TrainConfig

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
    if typing.get_origin(hint) is list:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
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
    checks the components run), then the cross-field rules of each section and of each chosen
    plugin, in the order of :data:`mcore_rl.config.rules.RULES`: the files and directories the
    config names (data files through the task's check, the Hugging Face checkpoint directories
    and their tokenizer: :mod:`mcore_rl.config.paths`), and the combinations that no run can
    satisfy (parallel layout vs model shape and workers (the policy's and, with
    ``algorithm: ppo``, the critic's), device-only features, the generation backend's needs,
    lengths, streaming, GRPO and PPO batch arithmetic).

    Raises:
        ConfigError: naming every violation's keys: ``invalid config: <problem>`` for one,
            else one problem per line.
    """
    field_errors = checks.errors(cfg)
    errors = list(field_errors) + rule_errors(cfg, field_errors)
    if len(errors) == 1:
        raise ConfigError(f"invalid config: {errors[0]}")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
