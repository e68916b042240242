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
from mcore_rl.config.registry import load, task_entry, task_errors
from mcore_rl.config.schema import DataConfig
from mcore_rl.data.batch import Batch
from mcore_rl.data.example import Example

logger = logging.getLogger("mcore_rl.data")


def prompt_messages(example: Example, template: str = "{question}",
                    system_prompt: Optional[str] = None) -> List[Dict[str, str]]:
    """The chat messages of ``example``'s prompt: its ``messages`` as they are, or one ``user``
    turn of ``template.format(question=example.prompt)``; with ``system_prompt`` a ``system``
    turn first, unless the messages have one."""
    if example.messages:
        messages = [dict(m) for m in example.messages]
    else:
        messages = [{"role": "user", "content": template.format(question=example.prompt)}]
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _plain_text(example: Example, template: str, system_prompt: Optional[str]) -> str:
    """A prompt without a chat template: the template's text (messages: their contents, one a
    line), after the system prompt's own line."""
    if example.messages:
        return "\n".join(m["content"] for m in prompt_messages(example, template, system_prompt))
    text = template.format(question=example.prompt)
    return text if system_prompt is None else f"{system_prompt}\n{text}"


class PromptDataset:
    """Examples with their prompts rendered and tokenized up front.

    The prompt is :func:`prompt_messages`: with ``use_chat_template`` and a tokenizer that has
    a chat template, rendered by ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``
    and tokenized without adding special tokens (the template carries them); otherwise its plain
    text (``template.format(question=example.prompt)``, after ``system_prompt``'s line; a
    chat-format example's contents, one a line) is tokenized with the tokenizer's special
    tokens (e.g. a Llama bos; none for the character tokenizer). A chat template requested but
    absent falls back to plain text with a warning.

    Attributes:
        examples: the ``N`` examples kept, in order.
        texts: ``N`` rendered prompt strings.
        input_ids: ``N`` lists of prompt token ids (python ints), each 1 to
            ``max_prompt_length`` long.
        solution_ids: ``N`` lists of token ids of ``example.solution`` (no special tokens).
        dropped: prompts longer than ``max_prompt_length`` left out (``filter_long_prompts``).

    Raises:
        ConfigError: no examples; ``template`` has a field other than ``{question}`` or lacks
            it (``data.prompt_template``); ``max_prompt_length < 1``; a prompt of zero tokens
            or, without ``filter_long_prompts``, one longer than ``max_prompt_length`` tokens
            (the message names the example's ``source``, its length and
            ``data.max_prompt_length``); every prompt too long with ``filter_long_prompts``.
    """

    def __init__(self, examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase,
                 template: str = "{question}", use_chat_template: bool = False,
                 max_prompt_length: int = 32, system_prompt: Optional[str] = None,
                 filter_long_prompts: bool = False):
        if not examples:
            raise ConfigError("empty dataset: no examples to build prompts from")
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        if fields != {"question"}:
            raise ConfigError(f"data.prompt_template={template!r}: expected exactly the field "
                              f"{{question}}, found {sorted(fields)}")
        check_value("data.max_prompt_length", max_prompt_length)
        chat = use_chat_template and tokenizer.chat_template is not None
        if use_chat_template and not chat:
            logger.warning("data.use_chat_template is true but the tokenizer has no chat "
                           "template: prompts are plain text")
        if chat:
            texts = [tokenizer.apply_chat_template(prompt_messages(ex, template, system_prompt),
                                                   tokenize=False, add_generation_prompt=True)
                     for ex in examples]
        else:
            texts = [_plain_text(ex, template, system_prompt) for ex in examples]
        prompt_ids = tokenizer(texts, add_special_tokens=not chat)["input_ids"]
        keep = []
        for i, (ex, ids) in enumerate(zip(examples, prompt_ids)):
            if len(ids) > max_prompt_length and filter_long_prompts:
                continue
            if not 1 <= len(ids) <= max_prompt_length:
                raise ConfigError(f"{ex.source}: prompt is {len(ids)} tokens; it must be 1 to "
                                  f"data.max_prompt_length={max_prompt_length} tokens")
            keep.append(i)
        self.dropped: int = len(examples) - len(keep)
        if not keep:
            raise ConfigError(f"data.filter_long_prompts dropped all {len(examples)} prompts "
                              f"(the first: {examples[0].source}): each is longer than "
                              f"data.max_prompt_length={max_prompt_length} tokens")
        self.examples: List[Example] = [examples[i] for i in keep]
        self.texts: List[str] = [texts[i] for i in keep]
        self.input_ids: List[List[int]] = [list(prompt_ids[i]) for i in keep]
        self.solution_ids: List[List[int]] = [list(ids) for ids in tokenizer(
            [ex.solution for ex in self.examples], add_special_tokens=False)["input_ids"]]

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
    :func:`mcore_rl.data.gsm8k.task_examples`; ``dataset``:
    :func:`mcore_rl.data.dataset.task_examples`) or the user's function its import path names,
    rendered and tokenized (:class:`PromptDataset`); prompts dropped by
    ``data.filter_long_prompts`` are counted in a warning and in each dataset's ``dropped``.

    Returns:
        ``(train, test)``; ``test`` is None when the run has no validation set.

    Raises:
        ConfigError: a ``data`` key outside its declared choices or bounds, a problem of
            :func:`~mcore_rl.config.registry.task_errors` (``data.train_path`` null or missing for
            gsm8k, set for synthetic, ...), a user's task that returns other than examples, and
            the errors of the loaders and :class:`PromptDataset`.
    """
    problems = errors(cfg, "data") + task_errors(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    train, test = load(task_entry(cfg.task).examples)(cfg, seed)
    wrong = [type(e).__name__ for e in list(train) + list(test) if not isinstance(e, Example)]
    if wrong:  # a user's task (data.task=module:function)
        raise ConfigError(f"data.task={cfg.task} must return (train, test) lists of "
                          f"mcore_rl.data.example.Example; got a {wrong[0]} among them")

    def dataset(examples: List[Example], split: str) -> PromptDataset:
        data = PromptDataset(examples, tokenizer, cfg.prompt_template, cfg.use_chat_template,
                             cfg.max_prompt_length, cfg.system_prompt, cfg.filter_long_prompts)
        if data.dropped:
            logger.warning("data: %d of the %d %s prompts are longer than "
                           "data.max_prompt_length=%d tokens and were dropped "
                           "(data.filter_long_prompts)", data.dropped, len(examples), split,
                           cfg.max_prompt_length)
        return data

    return dataset(train, "training"), (dataset(test, "held-out") if test else None)


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
