"""The hf rollout engine in processes of its own (``generation.num_workers`` > 0).

Each process (:class:`GenerationWorker`, a Ray actor or a plain process of a worker group,
placed as the ``generation`` group of :mod:`mcore_rl.controller.placement`) holds a
:class:`~mcore_rl.generation.hf.HFGenerationBackend` and the policy version of its weights.
:class:`RemoteGeneration` is the controller's side: a
:class:`~mcore_rl.generation.base.GenerationBackend` whose calls spread prompt groups over the
processes, and the two calls a streaming controller (:mod:`mcore_rl.controller.streaming`)
drives the processes with one by one: :meth:`RemoteGeneration.submit` (prompt groups to one
process -> a future of its finished groups and the version that generated them) and
:meth:`RemoteGeneration.push` (new weights with their version, queued behind the calls a process
has already been given).

Sampling is the in-process backend's: the rows of a part carry their row numbers of the whole
call (``first_row``), so whichever process decodes a prompt group, its random streams are those
of the same call in one process.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, as_completed
from typing import Dict, Iterator, List, Tuple

import torch

from mcore_rl.generation.base import (BackendContext, FinishedGroup, GenerationBackend,
                                      GroupAssembler, check_lengths, check_prompts)


class GenerationWorker:
    """One rollout process: an :class:`~mcore_rl.generation.hf.HFGenerationBackend` (fp32) and
    ``version``, the policy version of its weights (-1 before the first
    :meth:`update_weights`). Built by a worker group (``rank`` ... ``master_port`` are the
    group's; no ``torch.distributed`` world is formed).

    Args:
        hf_config: the policy's ``transformers.PretrainedConfig`` (eos and pad ids set).
        generation: the ``generation`` config.
        eos_token_id, pad_token_id: as for the backend.
        max_total_length: ``data.max_total_length``.
        device: ``"cpu"`` or ``"cuda"`` (the process's GPU: ``LOCAL_RANK``, or the one Ray
            gave it).
        threads: torch CPU threads on the cpu device (``cluster.threads_per_worker``; 0: one).
    """

    def __init__(self, hf_config, generation, eos_token_id: int, pad_token_id: int,
                 max_total_length: int, device: str, threads: int, rank: int = 0,
                 world_size: int = 1, master_addr: str = "", master_port: int = 0):
        from mcore_rl.generation.hf import HFGenerationBackend
        from mcore_rl.megatron.parallel import resolve_device

        device = resolve_device(device)  # pins the CPU arithmetic before any tensor work
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(threads or 1)
        self.rank = rank
        self.version = -1
        self.backend = HFGenerationBackend(hf_config, generation, eos_token_id, pad_token_id,
                                           max_total_length, device=device)

    def layout(self) -> Dict[str, int]:
        """``{"rank": r}`` (a worker group's construction probe)."""
        return {"rank": self.rank}

    def update_weights(self, weights: Dict[str, torch.Tensor], version: int) -> int:
        """Load the policy's Hugging Face-named weights (whole tensors) of policy version
        ``version``. Returns the bytes loaded. Raises ``ValueError`` as
        :meth:`HFGenerationBackend.update_weights` (the old weights stay unusable)."""
        self.backend.update_weights(weights.items())
        self.version = int(version)
        return self.backend.last_refit_bytes

    def generate(self, prompts: List[List[int]], seed: int, greedy: bool, group_size: int,
                 first_row: int) -> Tuple[int, List[FinishedGroup]]:
        """Decode ``prompts`` (whole groups of ``group_size``; rows numbered from ``first_row``
        for the random streams). Returns ``(version, groups)``: the policy version of the
        weights that decoded them and every finished group (``rows`` relative to
        ``prompts``). Raises as :meth:`HFGenerationBackend.generate_async`."""
        groups = list(self.backend.generate_async(prompts, seed, greedy, group_size, first_row))
        return self.version, groups

    def shutdown(self) -> None:
        """Nothing to release (the process ends with its group)."""


class RemoteGeneration(GenerationBackend):
    """The hf engine in ``generation.num_workers`` processes (:class:`GenerationWorker`).

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
        self._weights_loaded = False

    @classmethod
    def from_context(cls, ctx: BackendContext) -> "RemoteGeneration":
        """``generation.num_workers`` processes placed as the run's ``generation`` group."""
        cfg = ctx.cfg
        check_lengths(cfg.generation, cfg.data.max_total_length)
        group = ctx.placement.make_group("generation", GenerationWorker, dict(
            hf_config=ctx.hf_config, generation=cfg.generation, eos_token_id=ctx.eos_token_id,
            pad_token_id=ctx.pad_token_id, max_total_length=cfg.data.max_total_length,
            device=ctx.device, threads=cfg.cluster.threads_per_worker))
        return cls(group, ctx.vocab_size, cfg.data.max_total_length, ctx.pad_token_id)

    # ------------------------------------------------------------------ one process at a time
    def push(self, weights: Dict[str, torch.Tensor], version: int) -> Future:
        """Send ``weights`` (Hugging Face names, whole tensors) of policy ``version`` to every
        live process; each loads them after the calls it was given before. Returns a future of
        the bytes each loaded (:class:`~mcore_rl.controller.worker_group.WorkerError` naming the
        processes that failed or are gone)."""
        self._weights_loaded = True
        return self.group.call_each_async("update_weights", [[weights, version]] * len(self.alive),
                                          ranks=self.alive)

    def submit(self, worker: int, prompts: List[List[int]], seed: int, group_size: int,
               first_row: int, greedy: bool = False) -> Future:
        """Start decoding ``prompts`` (whole groups) on process ``worker`` and return at once.

        Returns:
            a future of ``(version, groups)`` (:meth:`GenerationWorker.generate`), or of a
            :class:`~mcore_rl.controller.worker_group.WorkerError` (its ``gone``: the process
            died).
        """
        from mcore_rl.controller.worker_group import then

        return then(self.group.call_each_async(
            "generate", [[prompts, seed, greedy, group_size, first_row]], ranks=[worker]),
            lambda outs: outs[0])

    def drop(self, worker: int) -> None:
        """Stop sending to process ``worker`` (it died)."""
        if worker in self.alive:
            self.alive.remove(worker)

    # ------------------------------------------------------------------ GenerationBackend
    def refit(self, policy, version: int = 0) -> Dict[str, float]:
        """Pull the policy's Hugging Face-named weights (``get_hf_weights``) and load them in
        every live process as policy ``version``; waits. Returns ``refit/gbytes`` (per
        process)."""
        loaded = self.push(policy.call("get_hf_weights")[0], version).result()
        return {"refit/gbytes": loaded[0] / 1e9}

    def generate_async(self, prompts: List[List[int]], seed: int, greedy: bool = False,
                       group_size: int = 1) -> Iterator[FinishedGroup]:
        """See :meth:`GenerationBackend.generate_async`: the groups are cut into one contiguous
        part per live process, all started at once; a part's groups come when it is done."""
        if not self._weights_loaded:
            raise RuntimeError("RemoteGeneration.generate: no weights were loaded; refit first")
        check_prompts(prompts, self.vocab_size, self.max_total_length)
        GroupAssembler(len(prompts), group_size)  # checks the group size
        groups = len(prompts) // group_size
        bounds = [round(i * groups / len(self.alive)) * group_size for i in range(len(self.alive) + 1)]
        parts = {self.submit(w, prompts[a:b], seed, group_size, a, greedy): a
                 for w, a, b in zip(self.alive, bounds[:-1], bounds[1:]) if b > a}
        return self._finished(parts)

    @staticmethod
    def _finished(parts: Dict[Future, int]) -> Iterator[FinishedGroup]:
        for future in as_completed(parts):
            offset = parts[future]
            for g in future.result()[1]:
                yield FinishedGroup(range(g.rows.start + offset, g.rows.stop + offset), g.responses)

    def shutdown(self) -> None:
        self.group.shutdown()
