"""Math answer verifier (GSM8K and similar) on top of Hugging Face ``math-verify``."""

from __future__ import annotations

import functools
import threading

from math_verify import parse, verify

from mcore_rl.data.example import Example

# Seconds math-verify may spend parsing or comparing one answer.
TIMEOUT_SECONDS = 5


@functools.lru_cache(maxsize=65536)
def _parsed_gold(answer: str, timeout) -> tuple:
    """math-verify's ``parse`` of a ground-truth answer, kept per process: a prompt's
    ``grpo.num_generations`` responses (and every later step that samples it) share one answer,
    whose parse was a third of a sample's verification. ``parse`` is a pure function of the
    text and its results (SymPy objects, strings) are immutable, so a kept one verifies as a
    fresh one; a parse that raises (a timeout) is not kept."""
    return tuple(parse(answer, parsing_timeout=timeout))


def gold_answer(answer: str) -> str:
    """The ground truth of an answer column: the text after its last ``####`` (GSM8K's whole
    reasoning, ``"... #### 1,080"``, as ``data.task=dataset`` passes it) with thousands
    separators removed, else ``answer`` as it is (``data.task=gsm8k`` has parsed it already)."""
    _, sep, final = answer.rpartition("####")
    return final.strip().replace(",", "") if sep else answer


def math_reward(response: str, example: Example) -> float:
    """1.0 when the response's final answer equals ``example.answer`` (its :func:`gold_answer`)
    mathematically, else 0.0.

    The final answer is the text after the response's first ``####`` up to the end of that
    line (the GSM8K format; anything the model wrote after it is ignored) when there is one;
    otherwise math-verify extracts it from the whole response (``The answer is N``,
    ``\\boxed{N}``, else the last number). ``verify`` compares numbers, fractions and
    expressions ("1,000" equals "1000"; "0.5" equals "1/2").

    math-verify enforces its timeouts with ``signal.alarm``, which only works in the main
    thread; in any other thread (a threaded Ray actor, a thread pool) the timeouts are off.
    The parsed ground truth is kept per process (:func:`_parsed_gold`).

    Raises:
        ValueError: ``example.answer`` cannot be parsed (names ``example.source``).
    """
    timeout = TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    gold = list(_parsed_gold(gold_answer(example.answer), timeout))
    if not gold:
        raise ValueError(f"{example.source}: cannot parse the ground-truth answer "
                         f"{example.answer!r}")
    _, sep, after = response.partition("####")
    candidate = after.split("\n", 1)[0] if sep else response
    prediction = parse(candidate, parsing_timeout=timeout)
    return float(verify(gold, prediction, timeout_seconds=timeout))
