"""Load-time config checks of the generation backends (named by their entries in
:mod:`mcore_rl.generation.registry`). Torch-free: the config loader imports this module, and
loading a config stays fast."""

from __future__ import annotations

from typing import List

from mcore_rl.config.schema import MegatronConfig, TrainConfig


def megatron_layout_errors(megatron: MegatronConfig) -> List[str]:
    """Why ``generation.backend=megatron`` (decoding with the policy's own model,
    :mod:`mcore_rl.generation.megatron`) cannot run on the policy layout ``megatron``
    (``policy.megatron``), one message per reason naming its keys; empty when it can. Refused:
    pipeline parallelism (virtual stages included), sequence parallelism (a one-token decode
    step cannot be split over TP ranks) and expert parallelism (each DP rank decodes its own
    prompts for its own number of steps, while an MoE layer's token exchange over the EP group,
    which spans DP ranks, needs every rank in each step)."""
    errors = []
    if megatron.pipeline_model_parallel_size != 1 or megatron.virtual_pipeline_model_parallel_size:
        errors.append("generation.backend=megatron needs policy.megatron.pipeline_model_parallel_size"
                      f"=1 and no virtual_pipeline_model_parallel_size (got "
                      f"{megatron.pipeline_model_parallel_size}, "
                      f"{megatron.virtual_pipeline_model_parallel_size}); use generation.backend=hf")
    if megatron.sequence_parallel:
        errors.append("generation.backend=megatron needs policy.megatron.sequence_parallel=false")
    if megatron.expert_model_parallel_size != 1:
        errors.append("generation.backend=megatron needs policy.megatron.expert_model_parallel_size"
                      f"=1 (got {megatron.expert_model_parallel_size}); use generation.backend=hf")
    return errors


def megatron_config_errors(cfg: TrainConfig) -> List[str]:
    """The load-time check of ``generation.backend=megatron``: :func:`megatron_layout_errors`
    of ``policy.megatron``."""
    return megatron_layout_errors(cfg.policy.megatron)
