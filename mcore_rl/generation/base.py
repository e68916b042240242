"""The generation (rollout) backend interface and its factory.

A backend turns tokenized prompts into a right-padded rollout batch (keys and logprob
convention in :mod:`mcore_rl.data.batch`) and takes the policy's weights by refit.
"""

from __future__ import annotations

import abc
from typing import Iterable, List, Tuple

import torch

from mcore_rl.data.batch import Batch

BACKENDS = ("hf",)


class GenerationBackend(abc.ABC):
    """A rollout engine: ``generate`` samples responses, ``update_weights`` refits it."""

    # True for a backend that decodes with the policy workers' own weights in place: the
    # controller then exports nothing at refit; False for a backend with its own copy (``hf``).
    shares_policy_weights: bool = False

    @abc.abstractmethod
    def generate(self, prompts: List[List[int]], seed: int, greedy: bool = False) -> Batch:
        """Sample one response per prompt.

        Args:
            prompts: B token-id lists, each non-empty.
            seed: seeds the sampling RNG; the same seed, prompts and weights give the same
                rollouts (how a resumed run reproduces a straight one).
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

    ``"hf"``: :class:`mcore_rl.generation.hf.HFGenerationBackend`.

    Raises:
        ValueError: ``name`` is not a known backend.
    """
    if name == "hf":
        from mcore_rl.generation.hf import HFGenerationBackend

        return HFGenerationBackend(**kwargs)
    raise ValueError(f"generation.backend: unknown backend {name!r}; choose one of {list(BACKENDS)}")
