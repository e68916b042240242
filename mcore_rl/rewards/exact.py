"""Exact-answer verifier for the synthetic arithmetic task."""

from __future__ import annotations

import re

from mcore_rl.data.example import Example

_INTEGER = re.compile(r"-?\d+")


def exact_reward(response: str, example: Example) -> float:
    r"""1.0 when the response's first line, stripped of surrounding whitespace, is an integer
    equal to ``example.answer``, else 0.0. For answer ``"68"``: ``"68"``, ``" 68\n1+2="`` and
    ``"068"`` score 1; ``"68 1"``, ``"+68"``, ``"68.0"`` and ``""`` score 0.

    ``response`` is the decoded response without special tokens (generation ends at eos).

    Raises:
        ValueError: ``example.answer`` is not an integer (names ``example.source``).
    """
    if not _INTEGER.fullmatch(example.answer):
        raise ValueError(f"{example.source}: answer {example.answer!r} is not an integer")
    first_line = response.split("\n", 1)[0].strip()
    return float(bool(_INTEGER.fullmatch(first_line)) and int(first_line) == int(example.answer))
