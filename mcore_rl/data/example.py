"""The task-independent example record that datasets produce and reward verifiers check."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One prompt of a task with its ground truth.

    Attributes:
        prompt: the question text, before the prompt template and chat template.
        answer: the ground-truth final answer as text (e.g. ``"68"``, ``"1080"``).
        solution: a full reference response for a supervised warm start; the trainer
            appends the tokenizer's eos, so it carries none.
        source: where the example comes from, for error messages and logs:
            ``"<file>:<line>"`` or ``"synthetic:<split>:<index>"``.
    """

    prompt: str
    answer: str
    solution: str
    source: str
