"""The generation (rollout) backend interface, the context a backend is built from, and what
every backend shares: config and prompt checks, response budgets, prompt groups finished as they
complete, and the right-padded rollout batch.

A backend turns tokenized prompts into a right-padded rollout batch (keys and logprob
convention in :mod:`mcore_rl.data.batch`; sampling in :mod:`mcore_rl.generation.sampling`) and
owns its refit channel: it takes the policy's weights the way its engine needs them. Backends
are found by name in :mod:`mcore_rl.generation.registry`; the controller never branches on a
name.
"""

from __future__ import annotations

import abc
import dataclasses
from concurrent.futures import Future, as_completed
from typing import (TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, NamedTuple, Optional,
                    Sequence, Tuple)

import torch

from mcore_rl.config.checks import check, check_value
from mcore_rl.config.schema import GenerationConfig, TrainConfig
from mcore_rl.data.batch import Batch

if TYPE_CHECKING:
    from mcore_rl.distributed.placement import Placement
    from mcore_rl.distributed.worker_group import DataParallelGroup


@dataclasses.dataclass
class BackendContext:
    """Everything a backend may be built from (:meth:`GenerationBackend.from_context`).

    Attributes:
        cfg: the run's whole config (``generation``, ``data.max_total_length``, ``cluster``,
            ``policy.megatron``, ...).
        hf_config: the policy's ``transformers.PretrainedConfig`` (eos and pad ids set).
        eos_token_id: ends a response (kept as its last token).
        pad_token_id: fills ``input_ids`` after a row's end.
        vocab_size: the policy's real vocabulary (prompt ids are checked against it).
        device: ``"cpu"`` or ``"cuda"`` (``cluster.device`` resolved).
        policy: the policy's worker group (:class:`~mcore_rl.distributed.worker_group.
            DataParallelGroup`), for a backend that decodes on it or pulls weights from it.
        placement: the run's :class:`~mcore_rl.distributed.placement.Placement`; a backend with
            worker groups of its own (:meth:`GenerationBackend.worker_groups`) builds them with
            ``placement.make_group`` or places its processes with ``placement.actor_options``.
    """

    cfg: TrainConfig
    hf_config: Any
    eos_token_id: int
    pad_token_id: int
    vocab_size: int
    device: str
    policy: Optional["DataParallelGroup"]
    placement: Optional["Placement"]


class Response(NamedTuple):
    """One decoded response: ``tokens`` ``[R]`` int64 and their ``logprobs`` ``[R]`` float32 on
    the CPU (R >= 1, eos included when it ended the response), and ``truncated`` (the response
    hit its budget without eos)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    truncated: bool


class FinishedGroup(NamedTuple):
    """A prompt group whose responses are all decoded (:meth:`GenerationBackend.
    generate_async`): ``rows``, its rows of the ``generate_async`` call (``group_size``
    consecutive indices), and their ``responses`` in that order. Its rollout batch:
    ``assemble_rollout([prompts[i] for i in rows], responses, pad_token_id)``."""

    rows: range
    responses: List[Response]


class GenerationBackend(abc.ABC):
    """A rollout engine: :meth:`generate_async` (and :meth:`generate` on it) samples responses,
    :meth:`refit` takes the policy's weights.

    Attributes:
        shares_policy_weights: True for a backend that decodes with the policy workers' own
            weights in place (``megatron``): its refit exports nothing, and a colocated policy
            keeps its weights on the device for generation
            (:class:`~mcore_rl.controller.colocation.Colocation`); False (default) for a
            backend with a copy of its own.
        pad_token_id: fills ``input_ids`` after a row's end (set by every backend).

    Colocated device hand-over (``cluster.colocate_generation``; the controller's
    :class:`~mcore_rl.controller.colocation.Colocation` calls them, in this order per step):
    :meth:`prepare_for_refit`, :meth:`refit`, :meth:`prepare_for_generation`, generation,
    :meth:`offload`. No-ops by default; an engine with its own device memory (vLLM:
    ``wake_up(tags=["weights"])``, ``wake_up(tags=["kv_cache"])``, ``sleep(level)``) frees and
    takes it back there.
    """

    shares_policy_weights: bool = False
    pad_token_id: int

    @property
    def needs_refit(self) -> bool:
        """True when the backend holds no usable copy of the policy's weights (a
        :class:`StreamingBackend` before its first refit, after a failed one, or after a sleep
        that discarded them: vLLM ``generation.vllm.sleep_level=2``), so a colocated
        hand-over without a refit (:meth:`~mcore_rl.controller.colocation.Colocation.
        prepare_for_generation`) refits instead. False by default."""
        return False

    # ------------------------------------------------------------------ construction
    @classmethod
    @abc.abstractmethod
    def from_context(cls, ctx: BackendContext) -> "GenerationBackend":
        """Build the backend of a run (the controller's only way to build one).

        Raises:
            ValueError: a ``generation.*`` value out of range (named).
        """

    @classmethod
    def worker_groups(cls, cfg: TrainConfig) -> Dict[str, int]:
        """Worker groups of its own that need a GPU per rank, by name -> ranks (an engine in
        processes of its own); placed with the run's training groups before anything is built
        (:mod:`mcore_rl.distributed.placement`; on the policy's GPUs with
        ``cluster.colocate_generation``). Default: none."""
        return {}

    # ------------------------------------------------------------------ refit
    @abc.abstractmethod
    def refit(self, policy: "DataParallelGroup") -> Dict[str, float]:
        """Take the policy's current weights through this backend's channel: pull its Hugging
        Face-named tensors (``policy.call("get_hf_weights")``), share them in place (nothing to
        do), or have them streamed into an engine in processes of its own (by HF name, in
        buckets). Collective over the policy's ranks when it calls them.

        Returns:
            stats, at least ``refit/gbytes`` (GB of weights each engine worker receives; 0
            when shared); a :class:`StreamingBackend`'s also ``refit/gbytes_sent``
            (:meth:`Push.stats`).

        Raises:
            ValueError: unknown names, shape mismatches, or parameters left unwritten.
        """

    # ------------------------------------------------------------------ rollouts
    @abc.abstractmethod
    def generate_async(self, prompts: List[List[int]], seed: int, greedy: bool = False,
                       group_size: int = 1,
                       stop_token_ids: Optional[Sequence[int]] = None) -> Iterator[FinishedGroup]:
        """Start sampling one response per prompt; yields each prompt group once all its rows
        are decoded, in the order groups finish.

        Args:
            prompts: B token-id lists, each non-empty; B a multiple of ``group_size``.
            seed: seeds the sampling RNG (one stream per row,
                :func:`mcore_rl.generation.sampling.row_uniforms`); the same seed, prompts and
                weights give the same rollouts (how a resumed run reproduces a straight one),
                whatever ``generation.batch_size``, ``group_size`` or the data-parallel layout.
            greedy: argmax decoding instead of sampling (validation).
            group_size: rows per group (GRPO: the responses of one prompt), group ``i`` being
                rows ``i * group_size .. (i + 1) * group_size - 1``.
            stop_token_ids: the tokens that end a response in this call (kept as its last
                token; a response that ends on none of them is truncated); None: the eos
                token alone (the one-turn path). The multi-turn loop
                (:mod:`mcore_rl.rollout.multi_turn`) passes eos and the chat template's
                end-of-turn token, with the conversation so far as each prompt.

        Returns:
            an iterator of :class:`FinishedGroup`. Checks run and, for an engine in processes
            of its own, decoding starts when this is called: the caller may do other work
            before iterating. An in-process backend may decode while it is iterated.

        Raises (at the call):
            RuntimeError: no weights were loaded yet.
            ValueError: a prompt is empty, has out-of-vocabulary ids, or leaves no room for a
                response; B is not a multiple of ``group_size``.
        """

    def generate(self, prompts: List[List[int]], seed: int, greedy: bool = False,
                 stop_token_ids: Optional[Sequence[int]] = None) -> Batch:
        """Sample one response per prompt (:meth:`generate_async`, waited for; ``stop_token_ids``
        as there).

        Returns:
            A right-padded batch, rows in prompt order, on the CPU: ``input_ids`` [B, S]
            int64, ``input_lengths``, ``prompt_lengths``, ``response_lengths`` [B] int64,
            ``token_mask`` [B, S] float32 (1 on response tokens, eos included),
            ``generation_logprobs`` [B, S] float32 (``log pi(x_t | x_<t)`` on response
            tokens, 0 elsewhere), ``truncated`` [B] float32 (1 when the response hit the
            length limit without eos). S is the longest row.

        Raises:
            As :meth:`generate_async`.
        """
        responses: List[Optional[Response]] = [None] * len(prompts)
        kwargs = {} if stop_token_ids is None else {"stop_token_ids": list(stop_token_ids)}
        for group in self.generate_async(prompts, seed, greedy, **kwargs):
            responses[group.rows.start:group.rows.stop] = group.responses
        return assemble_rollout(prompts, responses, self.pad_token_id)

    # ------------------------------------------------------------------ colocation, lifetime
    def prepare_for_refit(self) -> None:
        """Colocated: take back the device memory the refit writes into (the weights)."""

    def prepare_for_generation(self) -> None:
        """Colocated: take back the device memory decoding needs (KV cache)."""

    def offload(self) -> None:
        """Colocated: free this backend's device memory for the policy (logprobs, training)."""

    def shutdown(self) -> None:
        """Stop what the backend started (processes of its own); the backend is unusable."""


class Push(NamedTuple):
    """Weights of one policy version on their way into a :class:`StreamingBackend`'s workers
    (:meth:`StreamingBackend.push`): ``gbytes``, GB of weights each worker receives (the
    policy's, once); ``loaded``, a future of None once every live worker has loaded them (a
    :class:`~mcore_rl.distributed.worker_group.WorkerError` naming the workers that failed or
    are gone; a worker that failed to load refuses to decode until a good refit);
    ``sent_gbytes``, GB the sending side sent in all, over its processes: ``gbytes`` where one
    copy goes to every worker (a broadcast, files in host memory), more where each sender sends
    its own (vLLM over CUDA IPC: every policy rank the full tensors to the engine workers on
    its GPU, so four ranks send four copies)."""

    gbytes: float
    loaded: Future
    sent_gbytes: float

    def stats(self) -> Dict[str, float]:
        """``refit/gbytes`` (each worker's) and ``refit/gbytes_sent`` (in all)."""
        return {"refit/gbytes": self.gbytes, "refit/gbytes_sent": self.sent_gbytes}


class StreamingBackend(GenerationBackend):
    """A rollout engine in worker processes of its own (``alive``: the indices of the live
    ones), which a streaming controller (:mod:`mcore_rl.controller.streaming`) drives one worker
    at a time: :meth:`submit` gives a worker prompt groups and returns at once; :meth:`push`
    queues new weights, with their policy version, behind the calls each worker already holds,
    so each call's result carries the version of the weights that decoded it. A worker runs its
    calls in the order it got them. Implemented by
    :class:`~mcore_rl.generation.remote.RemoteGeneration` (``generation.backend=hf`` with
    ``generation.num_workers`` >= 1) and :class:`~mcore_rl.generation.vllm.
    VLLMGenerationBackend` (``generation.backend=vllm``: one worker per engine).

    Sampling: a row's random stream is fixed by the call's ``seed`` and its row number in the
    whole rollout (``first_row`` + its index in the call), so whichever worker decodes a prompt
    group, and with whatever other rows, its responses are those of the same rollout decoded in
    one call.
    """

    alive: List[int]
    vocab_size: int  # prompt ids are checked against it, and
    max_total_length: int  # prompt lengths against it, before anything is sent
    _weights_loaded: bool = False

    @property
    def needs_refit(self) -> bool:
        """See :attr:`GenerationBackend.needs_refit`: no weights loaded (or discarded)."""
        return not self._weights_loaded

    @abc.abstractmethod
    def submit(self, worker: int, prompts: List[List[int]], seed: int, group_size: int,
               first_row: int, greedy: bool = False,
               stop_token_ids: Optional[Sequence[int]] = None) -> Future:
        """Start decoding ``prompts`` (whole groups of ``group_size`` rows, numbered from
        ``first_row`` in the rollout for their random streams) on worker ``worker``; returns at
        once. ``stop_token_ids`` as in :meth:`GenerationBackend.generate_async`.

        Returns:
            a future of ``(version, groups)``: the policy version of the weights that decoded
            them and every :class:`FinishedGroup` (``rows`` relative to ``prompts``); or of a
            :class:`~mcore_rl.distributed.worker_group.WorkerError` (its ``gone``: the worker
            died).
        """

    @abc.abstractmethod
    def push(self, policy: "DataParallelGroup", version: int) -> Push:
        """Take the policy's current weights as policy version ``version`` and queue their load
        on every live worker, behind the calls it already holds. Returns once the policy's
        weights have left it (the policy may train on).

        Raises:
            ValueError: unknown names or shape mismatches found before any worker gets a tensor
                (the vllm backend's host-memory path checks them all first): the workers keep
                their weights. Found by a worker (hf), they fail ``loaded``.
        """

    def drop(self, worker: int) -> None:
        """Stop sending to worker ``worker`` (it died)."""
        if worker in self.alive:
            self.alive.remove(worker)

    def refit(self, policy: "DataParallelGroup", version: int = 0) -> Dict[str, float]:
        """:meth:`push` the policy's weights as ``version`` and wait until every live worker has
        loaded them. Returns :meth:`Push.stats`. Raises as :meth:`push`, and
        :class:`~mcore_rl.distributed.worker_group.WorkerError` when a worker failed to load
        (then :meth:`generate_async` refuses until a good refit)."""
        return self._loaded(self.push(policy, version))

    def _loaded(self, pushed: Push) -> Dict[str, float]:
        """Wait for ``pushed`` to be loaded everywhere; its stats."""
        try:
            pushed.loaded.result()
        except BaseException:
            self._weights_loaded = False
            raise
        self._weights_loaded = True
        return pushed.stats()

    def generate_async(self, prompts: List[List[int]], seed: int, greedy: bool = False,
                       group_size: int = 1,
                       stop_token_ids: Optional[Sequence[int]] = None) -> Iterator[FinishedGroup]:
        """See :meth:`GenerationBackend.generate_async`: the groups are cut into one contiguous
        part per live worker (:meth:`submit`), all started at once; a part's groups come when
        its worker is done.

        Raises (beyond the interface's): RuntimeError also after a failed refit, until a good
        one; :class:`~mcore_rl.distributed.worker_group.WorkerError` when iterated, when a worker
        raises.
        """
        if not self._weights_loaded:
            raise RuntimeError(f"{type(self).__name__}.generate: the engine holds no weights of the "
                               f"policy (none loaded yet, a failed refit, or discarded while it "
                               f"slept); refit from the policy first")
        check_prompts(prompts, self.vocab_size, self.max_total_length)
        GroupAssembler(len(prompts), group_size)  # checks the group size
        self.prepare_for_generation()
        groups, n = len(prompts) // group_size, len(self.alive)
        bounds = [round(i * groups / n) * group_size for i in range(n + 1)]
        stops = {} if stop_token_ids is None else {"stop_token_ids": list(stop_token_ids)}
        parts = {self.submit(w, prompts[a:b], seed, group_size, a, greedy, **stops): a
                 for w, a, b in zip(self.alive, bounds[:-1], bounds[1:]) if b > a}
        return self._finished(parts)

    @staticmethod
    def _finished(parts: Dict[Future, int]) -> Iterator[FinishedGroup]:
        for future in as_completed(parts):
            offset = parts[future]
            for g in future.result()[1]:
                yield FinishedGroup(range(g.rows.start + offset, g.rows.stop + offset), g.responses)


class GroupAssembler:
    """Collects responses of rows decoded in any order and hands out each prompt group of a
    ``generate_async`` call once it is complete.

    Args:
        num_rows: B, the call's prompts.
        group_size: rows per group.

    Raises:
        ValueError: ``group_size`` below 1 or not a divisor of ``num_rows``.
    """

    def __init__(self, num_rows: int, group_size: int):
        if group_size < 1 or num_rows % group_size:
            raise ValueError(f"generate_async: {num_rows} prompts do not split into groups of "
                             f"group_size={group_size}")
        self.group_size = group_size
        self._responses: List[Optional[Response]] = [None] * num_rows
        self._missing = [group_size] * (num_rows // group_size)

    def add(self, first_row: int, responses: List[Response]) -> List[FinishedGroup]:
        """Record the responses of rows ``first_row ..``; returns the groups they complete."""
        return self.add_rows(enumerate(responses, start=first_row))

    def add_rows(self, rows: Iterable[Tuple[int, Response]]) -> List[FinishedGroup]:
        """Record ``(row, response)`` pairs in any order; a row recorded before is skipped (a
        backend that sends rows ahead of its answer also has them in the answer). Returns the
        groups they complete."""
        done = []
        for i, response in rows:
            if self._responses[i] is not None:
                continue
            self._responses[i] = response
            g = i // self.group_size
            self._missing[g] -= 1
            if self._missing[g] == 0:
                rows = range(g * self.group_size, (g + 1) * self.group_size)
                done.append(FinishedGroup(rows, self._responses[rows.start:rows.stop]))
        return done


def check_lengths(cfg: GenerationConfig, max_total_length: int) -> None:
    """Raise ``ConfigError`` (a ``ValueError``) naming the key when a ``generation`` value or
    ``max_total_length`` (``data.max_total_length``) is outside what the schema declares
    (:mod:`mcore_rl.config.checks`, the check config loading runs)."""
    check(cfg, "generation")
    check_value("data.max_total_length", max_total_length)


def check_prompts(prompts: List[List[int]], vocab_size: int, max_total_length: int) -> None:
    """Raise ``ValueError`` naming the prompt's index when ``prompts`` is empty, or a prompt is
    empty, has ids outside ``[0, vocab_size)``, or leaves no room for a response under
    ``max_total_length`` (``data.max_total_length``)."""
    if not prompts:
        raise ValueError("generate: no prompts")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
        if len(prompt) >= max_total_length:
            raise ValueError(
                f"generate: prompt {i} has {len(prompt)} tokens, leaving no room for a response "
                f"under max_total_length (data.max_total_length) = {max_total_length}"
            )
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab_size}): {bad[:8]}")


def stop_ids(cfg: GenerationConfig, eos_token_id: int,
             stop_token_ids: Optional[Sequence[int]] = None) -> List[int]:
    """The tokens that end a response in one call: ``stop_token_ids`` when given, else the eos
    token; none with ``generation.ignore_eos`` (every response runs to its budget)."""
    if cfg.ignore_eos:
        return []
    return [int(eos_token_id)] if stop_token_ids is None else [int(t) for t in stop_token_ids]


def response_budgets(prompts: List[List[int]], max_new_tokens: int, max_total_length: int) -> List[int]:
    """Per prompt, the most response tokens it may get: ``min(max_new_tokens,
    max_total_length - len(prompt))``."""
    return [min(max_new_tokens, max_total_length - len(p)) for p in prompts]


def assemble_rollout(prompts: List[List[int]], responses: List[Response], pad_token_id: int) -> Batch:
    """The right-padded rollout batch of :meth:`GenerationBackend.generate` (its keys, shapes
    and dtypes), rows in prompt order, from each prompt's :class:`Response`."""
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    response_lengths = torch.tensor([len(r.tokens) for r in responses], dtype=torch.long)
    input_lengths = prompt_lengths + response_lengths
    b, s = len(prompts), int(input_lengths.max())
    input_ids = torch.full((b, s), pad_token_id, dtype=torch.long)
    token_mask = torch.zeros((b, s), dtype=torch.float32)
    generation_logprobs = torch.zeros((b, s), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        p, end = len(prompt), int(input_lengths[i])
        input_ids[i, :p] = torch.tensor(prompt, dtype=torch.long)
        input_ids[i, p:end] = response.tokens
        token_mask[i, p:end] = 1.0
        generation_logprobs[i, p:end] = response.logprobs
    return {
        "input_ids": input_ids,
        "input_lengths": input_lengths,
        "prompt_lengths": prompt_lengths,
        "response_lengths": response_lengths,
        "token_mask": token_mask,
        "generation_logprobs": generation_logprobs,
        "truncated": torch.tensor([float(r.truncated) for r in responses], dtype=torch.float32),
    }
