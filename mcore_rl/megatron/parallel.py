"""Process groups: ``torch.distributed`` and Megatron's ``parallel_state`` from the config.

One call, :func:`initialize`, per worker process. The device decides the backend: NCCL on a
GPU, gloo plus the CPU redirects of :mod:`mcore_rl.megatron.cpu_backend` on a CPU. Resolving
the device to the CPU also pins the process's CPU arithmetic (the controller's, before it
does any tensor work, and each worker's, before it builds its model), so a CPU run computes
the same bits on any x86-64 machine (:func:`~mcore_rl.megatron.cpu_backend.pin_arithmetic`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when a GPU is visible, else ``"cpu"``. On ``"cpu"`` it pins
    this process's CPU arithmetic and that of the processes it starts afterwards
    (:func:`~mcore_rl.megatron.cpu_backend.pin_arithmetic`): call it before any tensor work.
    Raises ``ValueError`` for ``"cuda"`` without a GPU (config key ``cluster.device``)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("cluster.device=cuda but no CUDA GPU is visible to this process")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"cluster.device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu":
        from mcore_rl.megatron import cpu_backend

        cpu_backend.pin_arithmetic()
    return device


def initialize(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: str,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    seed: int = 1234,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    context_parallel_size: int = 1,
) -> torch.device:
    """Join the process group and build Megatron's TP/CP/PP/DP groups and its expert groups
    (EP x expert TP x expert DP over the same ranks, Megatron's "MoE parallel folding";
    ``expert_tensor_parallel_size`` None: the TP size); seed Megatron's model-parallel RNG
    tracker. Returns the torch device of this rank.

    Context parallelism (``context_parallel_size`` CP > 1): Megatron's rank order is TP, CP,
    DP, PP (TP fastest); the DP group (:func:`~megatron.core.parallel_state.
    get_data_parallel_world_size`) then counts ``world / (TP x CP x PP)`` ranks, which is what
    shards a batch's rows, and the CP ranks of one DP rank hold the same rows.

    RNG (dropout), as Megatron-LM's ``_set_random_seed``: pipeline stage ``p`` uses
    ``seed + 100 p`` (layers of different stages draw different masks), and
    ``model_parallel_cuda_manual_seed`` makes the default generator equal on the TP ranks of a
    stage (dropout of replicated activations agrees) and the tracker's ``model-parallel-rng``
    differ per TP rank (dropout inside TP-split regions is independent per shard).

    Raises ``ValueError`` when ``world_size`` is not divisible by TP x CP x PP or by expert TP
    x EP x PP.
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size or tensor_model_parallel_size
    if world_size % (tp * cp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
            + (f"context_parallel_size ({cp}) x " if cp > 1 else "")
            + f"pipeline_model_parallel_size ({pp})"
        )
    if world_size % (etp * ep * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size ({etp}) x "
            f"expert_model_parallel_size ({ep}) x pipeline_model_parallel_size ({pp})"
        )
    device = resolve_device(device)
    if device == "cpu":
        from mcore_rl.megatron import cpu_backend

        cpu_backend.activate()
        torch_device = torch.device("cpu")
        backend = "gloo"
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
        backend = "nccl"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=30),
        )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
    model_parallel_cuda_manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    return torch_device


def destroy() -> None:
    """Tear down Megatron's groups and the process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
