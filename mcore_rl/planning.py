"""``mcore-rl plan``: the predicted per-GPU memory of a run (:mod:`mcore_rl.megatron.memory`),
printed before any worker starts, and the layouts of the same GPU count that fit.

Same config composition as ``train``; the model shape comes from ``model.hf_path``'s
``config.json`` or from ``model.arch`` (vocabulary: ``model.arch.vocab_size``, else the
tokenizer's).
"""

from __future__ import annotations

from typing import Tuple

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.schema import ModelArchConfig, TrainConfig
from mcore_rl.megatron import memory


def resolve_arch(cfg: TrainConfig) -> Tuple[ModelArchConfig, int]:
    """The run's model shape and vocabulary size, as the trainer resolves them.

    Raises:
        ConfigError: ``model.hf_path`` has no readable config or names a model this trainer
            does not build.
    """
    if cfg.model.hf_path:
        from transformers import AutoConfig

        from mcore_rl.megatron.conversion import hf_config_to_arch

        try:
            arch = hf_config_to_arch(AutoConfig.from_pretrained(cfg.model.hf_path))
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.hf_path: {cfg.model.hf_path}: {' '.join(str(e).split())}") from e
        return arch, arch.vocab_size
    arch = cfg.model.arch
    if arch.vocab_size is None:
        from mcore_rl.data.tokenizer import load_tokenizer

        return arch, len(load_tokenizer(cfg.model))
    return arch, arch.vocab_size


def run(cfg: TrainConfig) -> None:
    """Print the configured layout's plan, then every layout of ``cluster.num_workers`` GPUs
    with its largest fitting micro-batch."""
    arch, vocab = resolve_arch(cfg)
    plan = memory.plan_memory(cfg, arch, vocab)
    print(f"model: {memory.model_parameters(arch, vocab) / 1e6:.1f}M parameters "
          f"({arch.family}, {arch.num_layers} layers, hidden {arch.hidden_size}, vocab {vocab}); "
          f"policy.megatron.precision={cfg.policy.megatron.precision}, "
          f"generation.backend={cfg.generation.backend}, "
          f"seq {cfg.data.max_total_length} tokens (data.max_total_length)")
    print(memory.format_plan(plan))
    print(f"\nlayouts of {cfg.cluster.num_workers} GPU(s) (cluster.num_workers):")
    print(memory.format_layouts(memory.fitting_layouts(cfg, arch, vocab)))
