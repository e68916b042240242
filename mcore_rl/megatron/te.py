"""Transformer Engine at run time: what the config loader cannot know (it imports neither torch
nor TE, :func:`mcore_rl.config.rules.transformer_engine_errors`) checked where the GPU is: does
TE's PyTorch side import, and does this GPU run the FP8 recipe. The trainer calls
:func:`runtime_errors` before any worker starts and turns each message into a one-line
``ConfigError``; the model builder raises the same messages as ``ValueError`` for callers that
build a model themselves.

TE stays optional: nothing here imports it unless a config asks for a TE feature.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from mcore_rl.config.schema import (FP8_BLOCK_SCALES_ENV, FP8_BLOCK_SCALES_ENV_VALUES,
                                    FP8_RECIPE_CAPABILITY, MegatronConfig)


def uses_transformer_engine(megatron: MegatronConfig) -> bool:
    """Whether ``megatron`` asks for a Transformer Engine feature: the TE layer spec or FP8.
    Context parallelism (CP > 1) is TE's only with the TE spec: the ``torch`` spec does it
    itself (:mod:`mcore_rl.megatron.context_parallel`)."""
    return megatron.layer_spec == "transformer_engine" or megatron.fp8 is not None


def te_environment(megatron: MegatronConfig) -> Dict[str, str]:
    """The environment variables that the processes of a worker group running ``megatron``
    need before they import Transformer Engine: with ``fp8`` and ``fp8_recipe=blockwise``,
    ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` "1" (``fp8_block_scales=fp32``) or "0"
    (``power_of_2``), which TE reads once, when ``transformer_engine.common.recipe`` is imported
    (the default of ``Float8BlockScaling.use_f32_scales``); ``{}`` otherwise (FP8 off, another
    recipe). The trainer hands it to the group's placement
    (:meth:`mcore_rl.distributed.placement.Placement.make_group`).

    Raises:
        KeyError: ``fp8_block_scales`` is not one of the schema's choices (the loader refuses it
            first).
    """
    if megatron.fp8 is None or megatron.fp8_recipe != "blockwise":
        return {}
    return {FP8_BLOCK_SCALES_ENV: FP8_BLOCK_SCALES_ENV_VALUES[megatron.fp8_block_scales]}


def te_import_error() -> Optional[str]:
    """None when ``transformer_engine.pytorch`` imports here; else why not, on one line (the
    exception's type and message, whitespace collapsed). TE's top-level package swallows an
    ImportError of its PyTorch side, so the PyTorch module itself is imported. Importing it
    loads TE's CUDA libraries (the driver's ``libcuda`` among them): call it where the GPU is."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, OSError (a missing library), RuntimeError, assertions
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    return None


def fp8_capability_error(megatron: MegatronConfig, key: str,
                         capability: Tuple[int, int]) -> Optional[str]:
    """Why a GPU of CUDA compute ``capability`` (``(major, minor)``, e.g. ``(9, 0)`` for an
    H100) cannot run ``megatron.fp8`` with ``megatron.fp8_recipe`` (config section ``key``);
    None when it can or FP8 is off. The recipes' GPUs: :data:`~mcore_rl.config.schema.
    FP8_RECIPE_CAPABILITY`. Blockwise with ``fp8_block_scales=fp32`` runs on Hopper only:
    Transformer Engine's FP8 blockwise-scaling documentation says the fp32 scales relax the
    power-of-2 constraint on Hopper and that Blackwell (10.x and up) supports powers of 2 only."""
    if megatron.fp8 is None:
        return None
    low, refused = FP8_RECIPE_CAPABILITY[megatron.fp8_recipe]
    cap = tuple(capability)
    if cap >= low and (refused is None or cap < refused):
        if megatron.fp8_recipe == "blockwise" and megatron.fp8_block_scales == "fp32" \
                and cap >= (10, 0):
            return (f"{key}.fp8_block_scales=fp32 (its default) needs a Hopper GPU (compute "
                    f"capability 9.x); this GPU's is {cap[0]}.{cap[1]}, where Transformer "
                    f"Engine's block scales are powers of 2 only: set "
                    f"{key}.fp8_block_scales=power_of_2")
        return None
    where = f"compute capability >= {low[0]}.{low[1]}" + (
        f" and < {refused[0]}.{refused[1]}" if refused else "")
    return (f"{key}.fp8={megatron.fp8} with {key}.fp8_recipe={megatron.fp8_recipe} needs a GPU of "
            f"{where}; this GPU's is {cap[0]}.{cap[1]}"
            + ("" if megatron.fp8_recipe in ("delayed", "tensorwise") else
               "; fp8_recipe=delayed or tensorwise run from 8.9 (Ada, Hopper)"))


def runtime_errors(megatron: MegatronConfig, key: str, device: str,
                   capability: Optional[Tuple[int, int]] = None) -> List[str]:
    """Why ``megatron`` (config section ``key``) cannot run on this process's ``device``
    (``"cpu"`` or ``"cuda"``), one line each; empty when it can or uses no TE feature.

    Checked: TE's PyTorch side imports (:func:`te_import_error`; TE runs on GPUs only, so on
    ``"cpu"`` that is the message); the GPU runs the FP8 recipe (``capability``, default the
    current CUDA device's: :func:`fp8_capability_error`). Context parallelism on the TE spec
    (TE's p2p ring attention over the load-balanced chunks of :mod:`mcore_rl.megatron.
    context_parallel`) is not refused here: CP=2 against CP=1 on two H200s gave logprobs within
    1.3e-3 relative, grad norm 1.5e-3, packed sequences with p2p likewise (bench/RESULTS.md, issue
    34); packed sequences with TE's a2a or all_gather stay refused at load
    (:func:`mcore_rl.config.rules.context_parallel_errors`).
    """
    if not uses_transformer_engine(megatron):
        return []
    errors = []
    if device != "cuda":
        errors.append(f"{key}.layer_spec={megatron.layer_spec} with Transformer Engine features "
                      f"needs a GPU (device is {device})")
    else:
        problem = te_import_error()
        if problem:
            errors.append(f"Transformer Engine does not import here ({problem}), and {key} asks "
                          f"for it (layer_spec={megatron.layer_spec}, fp8={megatron.fp8}, "
                          f"context_parallel_size={megatron.context_parallel_size})")
        elif megatron.fp8 is not None:
            if capability is None:
                import torch

                capability = torch.cuda.get_device_capability()
            problem = fp8_capability_error(megatron, key, capability)
            if problem:
                errors.append(problem)
    return errors
