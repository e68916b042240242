"""The task-independent example record that datasets produce and reward verifiers check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class Example:
    """One prompt of a task with its ground truth.

    Attributes:
        prompt: the question text, before the prompt template and chat template (a chat-format
            example's last ``user`` turn).
        answer: the ground-truth final answer as text (e.g. ``"68"``, ``"1080"``; empty when
            the data set has none).
        solution: a full reference response for a supervised warm start; the trainer
            appends the tokenizer's eos, so it carries none.
        source: where the example comes from, for error messages and logs:
            ``"<file>:<line>"``, ``"<file>: row <i>"`` or ``"synthetic:<split>:<index>"``.
        messages: a chat-format prompt, ``({"role": ..., "content": ...}, ...)`` with at least
            one ``user`` turn, rendered with the chat template in place of ``prompt``
            (``data.messages_key``); None: ``prompt`` is the prompt.
        fields: the data set's other columns of this row (``data.task=dataset``), by column
            name, for rewards and environments (``example.fields["difficulty"]``); plain
            Python values (picklable: they reach the reward pool's processes).
    """

    prompt: str
    answer: str
    solution: str
    source: str
    messages: Optional[Tuple[Dict[str, str], ...]] = field(default=None, hash=False)
    fields: Dict[str, Any] = field(default_factory=dict, hash=False)
