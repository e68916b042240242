"""The ``mcore-rl`` command: ``mcore-rl COMMAND [--config-name NAME] [--config-path DIR] [--cfg]
[overrides...]``, e.g. ``mcore-rl train --config-name grpo_gsm8k model.hf_path=/m
grpo.num_generations=16``. Overrides use Hydra's grammar (``key=value``, ``+key=value``, ``~key``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from omegaconf import OmegaConf

import mcore_rl
from mcore_rl.config.loader import CONFIG_DIR_ENV, ConfigError, load_config
from mcore_rl.config.schema import TrainConfig


def _train(cfg: TrainConfig) -> None:
    """GRPO training (the controller prints its summary)."""
    from mcore_rl.controller.grpo import run  # deferred: heavy imports (torch, megatron, ray)

    run(cfg)


# Subcommand -> (help, default config name, function of the composed and validated config).
COMMANDS: dict[str, tuple[str, str, Callable[[TrainConfig], None]]] = {
    "train": ("GRPO training", "grpo_synthetic", _train),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), compose the config and run the subcommand.

    Returns 0 on success. Exits with status 2 (message on stderr, no traceback) on a usage error
    or a :class:`~mcore_rl.config.loader.ConfigError`.
    """
    parser = argparse.ArgumentParser(prog="mcore-rl", description=mcore_rl.__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, default_config, _) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--config-name", default=default_config,
                         help=f"YAML config, without .yaml (default: {default_config})")
        sub.add_argument("--config-path", default=None,
                         help=f"config directory (default: ${CONFIG_DIR_ENV}, else the "
                              "repository's configs/)")
        sub.add_argument("--cfg", action="store_true",
                         help="print the composed config as YAML and exit")
        sub.add_argument("overrides", nargs="*", help="key=value, +key=value, ~key")
    # parse_known_args: overrides may also follow the options (argparse stops '*' at an option).
    args, rest = parser.parse_known_args(argv)
    if any(a.startswith("-") for a in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        cfg = load_config(args.config_name, args.overrides + rest, args.config_path)
    except ConfigError as e:
        parser.exit(2, f"mcore-rl {args.command}: error: {e}\n")
    if args.cfg:
        print(OmegaConf.to_yaml(cfg), end="")
        return 0
    COMMANDS[args.command][2](cfg)
    return 0
