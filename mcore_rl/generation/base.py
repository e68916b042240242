"""The generation (rollout) backend interface, its factory, and what every backend shares:
config and prompt checks, response budgets, and the right-padded rollout batch.

A backend turns tokenized prompts into a right-padded rollout batch (keys and logprob
convention in :mod:`mcore_rl.data.batch`; sampling in :mod:`mcore_rl.generation.sampling`) and
takes the policy's weights by refit.
"""

from __future__ import annotations

import abc
from typing import Iterable, List, NamedTuple, Tuple

import torch

from mcore_rl.config.checks import check, check_value
from mcore_rl.config.schema import GENERATION_BACKENDS as BACKENDS
from mcore_rl.config.schema import GenerationConfig
from mcore_rl.data.batch import Batch


class GenerationBackend(abc.ABC):
    """A rollout engine: ``generate`` samples responses, ``update_weights`` refits it.

    Attributes:
        shares_policy_weights: True for a backend that decodes with the policy workers' own
            weights in place (``megatron``): the controller then exports nothing at refit and
            keeps the policy's weights on the device for generation (colocated offload
            lifecycle); False (default) for a backend with a copy of its own (``hf``).
    """

    shares_policy_weights: bool = False

    @abc.abstractmethod
    def generate(self, prompts: List[List[int]], seed: int, greedy: bool = False) -> Batch:
        """Sample one response per prompt.

        Args:
            prompts: B token-id lists, each non-empty.
            seed: seeds the sampling RNG (one stream per row,
                :func:`mcore_rl.generation.sampling.row_uniforms`); the same seed, prompts and
                weights give the same rollouts (how a resumed run reproduces a straight one),
                whatever ``generation.batch_size`` or the data-parallel layout.
            greedy: argmax decoding instead of sampling (validation).

        Returns:
            A right-padded batch, rows in prompt order, on the CPU: ``input_ids`` [B, S]
            int64, ``input_lengths``, ``prompt_lengths``, ``response_lengths`` [B] int64,
            ``token_mask`` [B, S] float32 (1 on response tokens, eos included),
            ``generation_logprobs`` [B, S] float32 (``log pi(x_t | x_<t)`` on response
            tokens, 0 elsewhere), ``truncated`` [B] float32 (1 when the response hit the
            length limit without eos). S is the longest row.

        Raises:
            RuntimeError: no weights were loaded yet.
            ValueError: a prompt is empty, has out-of-vocabulary ids, or leaves no room
                for a response.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Refit: copy full (unsharded) tensors, named as in Hugging Face checkpoints.

        Raises:
            ValueError: unknown names, shape mismatches, or parameters left unwritten.
        """


def get_backend(name: str, **kwargs) -> GenerationBackend:
    """The backend named by the config key ``generation.backend``, built with ``kwargs``.

    ``"hf"``: :class:`mcore_rl.generation.hf.HFGenerationBackend`; ``"megatron"``:
    :class:`mcore_rl.generation.megatron.MegatronGenerationBackend`.

    Raises:
        ValueError: ``name`` is not a known backend.
    """
    if name == "hf":
        from mcore_rl.generation.hf import HFGenerationBackend

        return HFGenerationBackend(**kwargs)
    if name == "megatron":
        from mcore_rl.generation.megatron import MegatronGenerationBackend

        return MegatronGenerationBackend(**kwargs)
    raise ValueError(f"generation.backend: unknown backend {name!r}; choose one of {list(BACKENDS)}")


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


def response_budgets(prompts: List[List[int]], max_new_tokens: int, max_total_length: int) -> List[int]:
    """Per prompt, the most response tokens it may get: ``min(max_new_tokens,
    max_total_length - len(prompt))``."""
    return [min(max_new_tokens, max_total_length - len(p)) for p in prompts]


class Response(NamedTuple):
    """One decoded response: ``tokens`` ``[R]`` int64 and their ``logprobs`` ``[R]`` float32 on
    the CPU (R >= 1, eos included when it ended the response), and ``truncated`` (the response
    hit its budget without eos)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    truncated: bool


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
