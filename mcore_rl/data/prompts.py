"""Tokenized prompt datasets, the resumable prompt sampler, the task loader, and supervised
(warm start) batches of prompt + reference solution."""

from __future__ import annotations

import logging
import string
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from mcore_rl.config.checks import ConfigError, check_value, errors
from mcore_rl.config.registry import TASKS, load, task_errors
from mcore_rl.config.schema import DataConfig
from mcore_rl.data.batch import Batch
from mcore_rl.data.example import Example

logger = logging.getLogger("mcore_rl.data")


class PromptDataset:
    """Examples with their prompts rendered and tokenized up front.

    The prompt text is ``template.format(question=example.prompt)``; with
    ``use_chat_template`` and a tokenizer that has a chat template, that text becomes one user
    message rendered by ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` and
    is tokenized without adding special tokens (the template carries them); otherwise the text
    is tokenized with the tokenizer's special tokens (e.g. a Llama bos; none for the character
    tokenizer). A chat template requested but absent falls back to plain text with a warning.

    Attributes:
        examples: the ``N`` examples, in order.
        texts: ``N`` rendered prompt strings.
        input_ids: ``N`` lists of prompt token ids (python ints), each 1 to
            ``max_prompt_length`` long.
        solution_ids: ``N`` lists of token ids of ``example.solution`` (no special tokens).

    Raises:
        ConfigError: no examples; ``template`` has a field other than ``{question}`` or lacks
            it (``data.prompt_template``); ``max_prompt_length < 1``; or a prompt longer than
            ``max_prompt_length`` tokens or of zero tokens (the message names the example's
            ``source``, its length and ``data.max_prompt_length``).
    """

    def __init__(self, examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase,
                 template: str = "{question}", use_chat_template: bool = False,
                 max_prompt_length: int = 32):
        if not examples:
            raise ConfigError("empty dataset: no examples to build prompts from")
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        if fields != {"question"}:
            raise ConfigError(f"data.prompt_template={template!r}: expected exactly the field "
                              f"{{question}}, found {sorted(fields)}")
        check_value("data.max_prompt_length", max_prompt_length)
        texts = [template.format(question=ex.prompt) for ex in examples]
        chat = use_chat_template and tokenizer.chat_template is not None
        if use_chat_template and not chat:
            logger.warning("data.use_chat_template is true but the tokenizer has no chat "
                           "template: prompts are plain text")
        if chat:
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                   add_generation_prompt=True) for t in texts]
        prompt_ids = tokenizer(texts, add_special_tokens=not chat)["input_ids"]
        for ex, ids in zip(examples, prompt_ids):
            if not 1 <= len(ids) <= max_prompt_length:
                raise ConfigError(f"{ex.source}: prompt is {len(ids)} tokens; it must be 1 to "
                                  f"data.max_prompt_length={max_prompt_length} tokens")
        self.examples: List[Example] = list(examples)
        self.texts: List[str] = texts
        self.input_ids: List[List[int]] = [list(ids) for ids in prompt_ids]
        self.solution_ids: List[List[int]] = [list(ids) for ids in tokenizer(
            [ex.solution for ex in examples], add_special_tokens=False)["input_ids"]]

    def __len__(self) -> int:
        return len(self.examples)


class PromptSampler:
    """Endless, deterministic, resumable stream of prompt indices.

    Epoch ``e`` visits the ``num_examples`` indices in the order
    ``np.random.default_rng((seed, e)).permutation(num_examples)``; a batch that reaches the
    end of an epoch continues into the next, so every batch has ``batch_size`` indices and a
    ``batch_size`` larger than the dataset repeats indices. Restoring :meth:`state_dict` into a
    sampler with the same ``num_examples`` and ``seed`` continues the exact same stream.

    Raises:
        ValueError: ``num_examples < 1`` or ``batch_size < 1``.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        if num_examples < 1 or batch_size < 1:
            raise ValueError(f"PromptSampler needs num_examples >= 1 and batch_size >= 1, got "
                             f"{num_examples} and {batch_size}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_examples)

    def next_batch(self) -> List[int]:
        """The next ``batch_size`` dataset indices."""
        batch: List[int] = []
        while len(batch) < self.batch_size:
            take = min(self.batch_size - len(batch), self.num_examples - self.position)
            batch.extend(int(i) for i in self._order[self.position:self.position + take])
            self.position += take
            if self.position == self.num_examples:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return batch

    def state_dict(self) -> Dict[str, int]:
        """``{"epoch", "position", "num_examples", "seed"}`` (plain ints, JSON-able)."""
        return {"epoch": self.epoch, "position": self.position,
                "num_examples": self.num_examples, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from ``state``. Raises ``ValueError`` when it was saved for another
        dataset size or seed (the resumed run would draw other prompts)."""
        for name in ("num_examples", "seed"):
            if state[name] != getattr(self, name):
                raise ValueError(f"prompt sampler state was saved with {name}={state[name]}, "
                                 f"this run has {name}={getattr(self, name)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


def load_task(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
              seed: int) -> Tuple[PromptDataset, Optional[PromptDataset]]:
    """Train and validation prompt datasets of ``data.task``: the examples of the task's entry
    in :data:`mcore_rl.config.registry.TASKS` (``synthetic``:
    :func:`mcore_rl.data.synthetic.task_examples`; ``gsm8k``:
    :func:`mcore_rl.data.gsm8k.task_examples`), rendered and tokenized.

    Returns:
        ``(train, test)``; ``test`` is None when the run has no validation set.

    Raises:
        ConfigError: a ``data`` key outside its declared choices or bounds, a problem of
            :func:`~mcore_rl.config.registry.task_errors` (``data.train_path`` null or missing for
            gsm8k, set for synthetic, ...), and the errors of the loaders and
            :class:`PromptDataset`.
    """
    problems = errors(cfg, "data") + task_errors(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    train, test = load(TASKS[cfg.task].examples)(cfg, seed)

    def dataset(examples: List[Example]) -> PromptDataset:
        return PromptDataset(examples, tokenizer, cfg.prompt_template, cfg.use_chat_template,
                             cfg.max_prompt_length)

    return dataset(train), (dataset(test) if test else None)


def sft_batch(dataset: PromptDataset, indices: Sequence[int], eos_token_id: int) -> Batch:
    """Supervised batch of prompt + reference solution + eos for rows ``indices``.

    Keys (B = ``len(indices)``, S = the longest row; rows right-padded with 0):
    ``input_ids`` [B, S] int64, ``input_lengths`` and ``prompt_lengths`` [B] int64,
    ``token_mask`` [B, S] float32 (1 on the solution and eos tokens), ``sample_mask`` [B]
    float32 ones. Rows are not truncated: keep ``data.max_total_length`` above the longest.

    Raises:
        ValueError: ``indices`` is empty.
    """
    if not indices:
        raise ValueError("sft_batch: no indices")
    return response_rows([(dataset.input_ids[i], dataset.solution_ids[i] + [eos_token_id])
                          for i in indices])


def response_rows(rows: Sequence[Tuple[List[int], List[int]]]) -> Batch:
    """Right-padded rows of ``(prompt ids, response ids)`` (the response as given, eos
    included if wanted): ``input_ids`` [B, S] int64 (padded with 0), ``input_lengths`` and
    ``prompt_lengths`` [B] int64, ``token_mask`` [B, S] float32 (1 on the response),
    ``sample_mask`` [B] float32 ones; S is the longest row."""
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    token_mask = torch.zeros(len(rows), width, dtype=torch.float32)
    for row, (prompt, response) in enumerate(rows):
        end = len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor(prompt + response)
        token_mask[row, len(prompt):end] = 1.0
    prompt_lengths = torch.tensor([len(p) for p, _ in rows], dtype=torch.long)
    return {"input_ids": input_ids,
            "input_lengths": prompt_lengths + torch.tensor([len(r) for _, r in rows]),
            "prompt_lengths": prompt_lengths,
            "token_mask": token_mask,
            "sample_mask": torch.ones(len(rows), dtype=torch.float32)}
