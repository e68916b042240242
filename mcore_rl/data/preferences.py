"""Preference pairs for reward-model training (``algorithm: rm``): the JSONL reader, their
tokenization into the rows the reward model scores, the batch of pairs, and a synthetic set.

File format: one JSON object per line, ``{"prompt": str, "chosen": str, "rejected": str}`` and
optionally ``"margin": number`` (>= 0; how much better the chosen response is rated, the margin
of :func:`mcore_rl.algorithms.preference.bradley_terry_loss`), the explicit-prompt form of TRL's
and OpenRLHF's preference data (``prompt`` may be ``""``: the responses hold everything). The
file is UTF-8 (a byte-order mark is skipped); blank lines are skipped.

Rows: a pair is tokenized as two rows that the reward model scores exactly as it scores a
rollout: the prompt rendered as the policy's prompts are (``data.prompt_template``, the chat
template with ``data.use_chat_template``: :class:`~mcore_rl.data.prompts.PromptDataset`), then
the response's tokens (no special tokens) and the tokenizer's eos, as a response that ended.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from mcore_rl.config.checks import ConfigError
from mcore_rl.data.batch import Batch
from mcore_rl.data.example import Example
from mcore_rl.data.dataset import read_records
from mcore_rl.data.prompts import PromptDataset, response_rows


@dataclass(frozen=True)
class PreferencePair:
    """One comparison: ``prompt``, the ``chosen`` and ``rejected`` responses (text), the
    ``margin`` (>= 0) and its ``source`` (``"<path>:<line>"``)."""

    prompt: str
    chosen: str
    rejected: str
    margin: float
    source: str


def load_preference_pairs(path: str | Path, key: Optional[str] = None) -> List[PreferencePair]:
    """Read preference pairs: JSONL (module docstring) or any format of the generic reader
    (:func:`mcore_rl.data.dataset.read_records`: JSON, Parquet, a saved data set).

    Args:
        path: the file.
        key: the config key that named it (``rm.train_path``); errors start with
            ``"<key>: "`` when given.

    Raises:
        ConfigError: ``"[<key>: ]<path>: no such file"``; ``"[<key>: ]<path>:<line>: ..."``
            for a line that is not UTF-8 or not a JSON object, lacks ``chosen`` or
            ``rejected`` (or has a non-string one, or a non-string ``prompt``), or has a
            ``margin`` that is not a number >= 0; ``"[<key>: ]<path>: no preference pairs"``
            for a file without any.
    """
    prefix = f"{key}: " if key else ""
    try:
        records = read_records(str(path), key)
    except ConfigError as e:  # the generic reader's "empty dataset (no JSON records)"
        if "empty dataset" not in str(e):
            raise
        raise ConfigError(f"{prefix}{path}: no preference pairs (an empty file)") from None
    return [_parse_pair(record, source, prefix) for source, record in records]


def _parse_pair(record, source: str, prefix: str) -> PreferencePair:
    found = ", ".join(repr(k) for k in record) or "none"
    for field in ("chosen", "rejected"):
        if not isinstance(record.get(field), str):
            what = "missing" if field not in record else "non-string"
            raise ConfigError(f"{prefix}{source}: {what} field {field!r} (a preference pair has "
                              f"string fields 'chosen' and 'rejected', and optionally 'prompt' "
                              f"and 'margin'; found {found})")
    prompt = record.get("prompt", "")
    if not isinstance(prompt, str):
        raise ConfigError(f"{prefix}{source}: field 'prompt' must be a string, got "
                          f"{type(prompt).__name__}")
    margin = record.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise ConfigError(f"{prefix}{source}: field 'margin' must be a number >= 0, got {margin!r}")
    return PreferencePair(prompt, record["chosen"], record["rejected"], float(margin), source)


class PreferenceDataset:
    """Preference pairs tokenized for the reward model (module docstring, "Rows").

    Args:
        pairs: the pairs.
        tokenizer: the run's tokenizer (eos set).
        template, use_chat_template, max_prompt_length: as for
            :class:`~mcore_rl.data.prompts.PromptDataset` (``data.*``).
        max_total_length: the longest row, prompt + response + eos (``data.max_total_length``).

    Attributes:
        pairs: the pairs, in order.
        prompt_ids: per pair, the rendered prompt's token ids.
        chosen_ids, rejected_ids: per pair, the response's token ids followed by eos.

    Raises:
        ConfigError: a prompt out of ``1 .. max_prompt_length`` tokens (as ``PromptDataset``),
            or a row longer than ``max_total_length``; each names the pair's source.
    """

    def __init__(self, pairs: Sequence[PreferencePair], tokenizer: PreTrainedTokenizerBase,
                 template: str, use_chat_template: bool, max_prompt_length: int,
                 max_total_length: int):
        examples = [Example(prompt=p.prompt, answer="", solution="", source=p.source) for p in pairs]
        prompts = PromptDataset(examples, tokenizer, template, use_chat_template, max_prompt_length)
        eos = [tokenizer.eos_token_id]
        self.pairs = list(pairs)
        self.prompt_ids = prompts.input_ids
        self.chosen_ids = [ids + eos for ids in tokenizer(
            [p.chosen for p in pairs], add_special_tokens=False)["input_ids"]]
        self.rejected_ids = [ids + eos for ids in tokenizer(
            [p.rejected for p in pairs], add_special_tokens=False)["input_ids"]]
        for i, pair in enumerate(self.pairs):
            longest = len(self.prompt_ids[i]) + max(len(self.chosen_ids[i]), len(self.rejected_ids[i]))
            if longest > max_total_length:
                raise ConfigError(f"{pair.source}: prompt + response + eos is {longest} tokens, "
                                  f"more than data.max_total_length={max_total_length}")

    def __len__(self) -> int:
        return len(self.pairs)


def pair_batch(data: PreferenceDataset, indices: Sequence[int]) -> Batch:
    """The rows of pairs ``indices``: pair ``j`` is rows ``2j`` (chosen) and ``2j + 1``
    (rejected).

    Keys (2P rows, S the longest; right-padded with 0): ``input_ids`` [2P, S] int64,
    ``input_lengths``, ``prompt_lengths`` [2P] int64, ``token_mask`` [2P, S] float32 (1 on the
    response and eos), ``chosen`` [2P] float32 (1, 0 per pair), ``margin`` [2P] float32 (the
    pair's), ``sample_mask`` [2P] float32 ones.

    Raises:
        ValueError: ``indices`` is empty.
    """
    if not indices:
        raise ValueError("pair_batch: no pairs")
    rows = [(data.prompt_ids[i], response) for i in indices
            for response in (data.chosen_ids[i], data.rejected_ids[i])]
    margins = torch.tensor([data.pairs[i].margin for i in indices], dtype=torch.float32)
    return {**response_rows(rows),
            "chosen": torch.tensor([1.0, 0.0]).repeat(len(indices)),
            "margin": margins.repeat_interleave(2)}


def synthetic_pairs(num_pairs: int, seed: int, max_value: int = 99) -> List[PreferencePair]:
    """A synthetic preference set over the synthetic task's prompts (``"a+b="``, operands in
    ``0 .. max_value``): the chosen response is the sum, the rejected one the sum moved by a
    non-zero offset in ``-9 .. 9`` (kept >= 0), so its last digit differs. Seeded; margins 0."""
    rng = random.Random(seed)
    pairs = []
    for i in range(num_pairs):
        a, b = rng.randint(0, max_value), rng.randint(0, max_value)
        offset = rng.choice([d for d in range(-9, 10) if d])
        wrong = a + b + offset if a + b + offset >= 0 else a + b - offset
        pairs.append(PreferencePair(f"{a}+{b}=", str(a + b), str(wrong), 0.0,
                                    f"synthetic:{seed}:{i}"))
    return pairs


def write_pairs(pairs: Sequence[PreferencePair], path: str | Path) -> None:
    """``pairs`` as a preference JSONL file (the format :func:`load_preference_pairs` reads;
    a margin of 0 is left out)."""
    with Path(path).open("w") as f:
        for p in pairs:
            record = {"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}
            if p.margin:
                record["margin"] = p.margin
            f.write(json.dumps(record) + "\n")
