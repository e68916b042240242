"""An in-process rollout engine in processes of its own: the hf engine with
``generation.num_workers`` > 0.

Each process (:class:`GenerationWorker`, a Ray actor or a plain process of a worker group,
placed as the ``generation`` group of :mod:`mcore_rl.distributed.placement`) holds an engine
(the class its backend passes: :class:`~mcore_rl.generation.hf.HFGenerationBackend`, whose
``from_context`` builds :class:`RemoteGeneration`; this module does not import it) and the
policy version of its weights.
:class:`RemoteGeneration` is the controller's side: a
:class:`~mcore_rl.generation.base.StreamingBackend` (prompt groups spread over the processes,
or given to one process at a time by a streaming controller; weights pushed with their version,
queued behind the calls a process has already been given).

Sampling is the in-process backend's: the rows of a part carry their row numbers of the whole
call (``first_row``), so whichever process decodes a prompt group, its random streams are those
of the same call in one process.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Dict, List, Optional, Tuple

import torch

from mcore_rl.generation.base import (BackendContext, FinishedGroup, Push, StreamingBackend,
                                      check_lengths)
from mcore_rl.workers.interfaces import GenerationWorkerAPI, PolicyAPI


class GenerationWorker:
    """One rollout process: an engine (fp32) and ``version``, the policy version of its weights
    (-1 before the first :meth:`update_weights`). Built by a worker group (``rank`` ...
    ``master_port`` are the group's; no ``torch.distributed`` world is formed).

    Args:
        engine: the in-process backend class, built as ``engine(hf_config, generation,
            eos_token_id, pad_token_id, max_total_length, device=...)``
            (:class:`~mcore_rl.generation.hf.HFGenerationBackend`).
        hf_config: the policy's ``transformers.PretrainedConfig`` (eos and pad ids set).
        generation: the ``generation`` config.
        eos_token_id, pad_token_id: as for the backend.
        max_total_length: ``data.max_total_length``.
        device: ``"cpu"`` or ``"cuda"`` (the process's GPU: ``LOCAL_RANK``, or the one Ray
            gave it).
        threads: torch CPU threads on the cpu device (``cluster.threads_per_worker``; 0: one).
    """

    def __init__(self, engine, hf_config, generation, eos_token_id: int, pad_token_id: int,
                 max_total_length: int, device: str, threads: int, rank: int = 0,
                 world_size: int = 1, master_addr: str = "", master_port: int = 0):
        from mcore_rl.megatron.parallel import resolve_device

        device = resolve_device(device)  # pins the CPU arithmetic before any tensor work
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(threads or 1)
        self.rank = rank
        self.version = -1
        self.backend = engine(hf_config, generation, eos_token_id, pad_token_id, max_total_length,
                              device=device)

    def layout(self) -> Dict[str, int]:
        """``{"rank": r}`` (a worker group's construction probe)."""
        return {"rank": self.rank}

    def update_weights(self, weights: Dict[str, torch.Tensor], version: int) -> None:
        """Load the policy's Hugging Face-named weights (whole tensors) of policy version
        ``version``. Raises ``ValueError`` as :meth:`HFGenerationBackend.update_weights` (the
        old weights stay unusable)."""
        self.backend.update_weights(weights.items())
        self.version = int(version)

    def generate(self, prompts: List[List[int]], seed: int, greedy: bool, group_size: int,
                 first_row: int, stop_token_ids: Optional[List[int]] = None,
                 ) -> Tuple[int, List[FinishedGroup]]:
        """Decode ``prompts`` (whole groups of ``group_size``; rows numbered from ``first_row``
        for the random streams). Returns ``(version, groups)``: the policy version of the
        weights that decoded them and every finished group (``rows`` relative to
        ``prompts``); ``stop_token_ids`` as there. Raises as
        :meth:`HFGenerationBackend.generate_async`."""
        groups = list(self.backend.generate_async(prompts, seed, greedy, group_size, first_row,
                                                  stop_token_ids))
        return self.version, groups

    def shutdown(self) -> None:
        """Nothing to release (the process ends with its group)."""


class RemoteGeneration(StreamingBackend):
    """An in-process engine (the hf one) in ``generation.num_workers`` processes
    (:class:`GenerationWorker`), one
    :class:`~mcore_rl.generation.base.StreamingBackend` worker each.

    Args:
        group: the worker group of :class:`GenerationWorker` (one process per rank).
        vocab_size, max_total_length: for the prompt checks made here, before anything is sent.
        pad_token_id: fills ``input_ids`` after a row's end.
    """

    def __init__(self, group, vocab_size: int, max_total_length: int, pad_token_id: int):
        self.group = group
        self.vocab_size = vocab_size
        self.max_total_length = max_total_length
        self.pad_token_id = pad_token_id
        self.alive = list(range(group.world_size))

    @classmethod
    def from_context(cls, ctx: BackendContext, engine) -> "RemoteGeneration":
        """``generation.num_workers`` processes of ``engine`` (:class:`GenerationWorker`)
        placed as the run's ``generation`` group."""
        cfg = ctx.cfg
        check_lengths(cfg.generation, cfg.data.max_total_length)
        group = ctx.placement.make_group("generation", GenerationWorker, dict(
            engine=engine, hf_config=ctx.hf_config, generation=cfg.generation, eos_token_id=ctx.eos_token_id,
            pad_token_id=ctx.pad_token_id, max_total_length=cfg.data.max_total_length,
            device=ctx.device, threads=cfg.cluster.threads_per_worker))
        return cls(group, ctx.vocab_size, cfg.data.max_total_length, ctx.pad_token_id)

    # ------------------------------------------------------------------ StreamingBackend
    def push(self, policy, version: int) -> Push:
        """Pull the policy's Hugging Face-named weights (``get_hf_weights``, whole tensors) and
        send them, as policy ``version``, to every live process; each loads them after the calls
        it was given before."""
        weights = policy.call(PolicyAPI).get_hf_weights()[0]
        loaded = self.group.call_each_async(GenerationWorkerAPI, ranks=self.alive).update_weights(
            [[weights, version]] * len(self.alive))
        gbytes = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
        return Push(gbytes, loaded, gbytes)

    def submit(self, worker: int, prompts: List[List[int]], seed: int, group_size: int,
               first_row: int, greedy: bool = False,
               stop_token_ids: Optional[List[int]] = None) -> Future:
        """See :meth:`StreamingBackend.submit` (:meth:`GenerationWorker.generate`)."""
        from mcore_rl.distributed.worker_group import then

        return then(self.group.call_each_async(GenerationWorkerAPI, ranks=[worker]).generate(
            [[prompts, seed, greedy, group_size, first_row, stop_token_ids]]),
            lambda outs: outs[0])

    def shutdown(self) -> None:
        self.group.shutdown()
