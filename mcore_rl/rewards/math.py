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


# Responses of the kinds a small model writes on GSM8K (a "####" line, "The answer is", a last
# number, decimals, percentages, fractions, LaTeX, symbols and equations, sets, units, other
# scripts and emoji, text with no number), each reaching parts of math-verify and SymPy that are
# built or imported on first use. Scored against each of WARM_UP_ANSWERS by warm_up().
WARM_UP_RESPONSES = (
    "48/2 = 24 clips in May.\n#### 72",
    "#### $1,080 dollars",
    "The answer is 71.",
    "So she has 1,000 apples left. The answer is: 1000",
    "She earns 1.5% more, that is 0.25 dollars an hour, 96.2 in all",
    "1.5*(1/100) of it, =40%",
    "So 3/4 of 12 is 9, and 2/3 + 1/6 = 5/6",
    "The final answer is $\\boxed{18}$ and \\(\\frac{1}{2}\\)",
    "$\\frac{3}{4} \\times 12 = 9$ and $\\sqrt{16} = 4$, $2^{3}$",
    "Let x = 4x + 2, so 2*8 = 16 and 4A = An; x^2 + 3 = 7 so x = 2",
    "The sides are (1, 2) and [3, 4], {5, 6}, 3 < y < 5",
    "It costs $5.50 at 3:45 pm, 1e5 grams, -7 degrees, 10 days",
    "The answer is: \U0001f3ad\U0001f3af \u2248 3 \u2234 \u221a4 = 2, \u00bd",
    "E = 2 \u00d7 38% = 38 \u00d7 0.38 = 13.8 and the $$$$ATIVE=$$",
    "$$x = \\dfrac{5}{2} \\cdot 4 = 10$$ so \\(\\text{cost} = \\$12\\) and 30\\% at 90^\\circ",
    "\\[ \\left( 3 + 4 \\right) \\div 7 = 1 \\]",
    "Natalia sold clips to 48 friends in April and then she sold half as many in May so we need "
    "to find the number of clips 2, 3, 4, 6, 8, 12, 16 and so the total is 4 * 2 = 8 A. But we",
    "I am not sure what to do here.",
    "",
)
WARM_UP_ANSWERS = ("72", "0.5", "1/2")


def warm_up() -> None:
    """Score :data:`WARM_UP_RESPONSES` against each of :data:`WARM_UP_ANSWERS` once, for
    nothing but the side effect: the reward pool's processes call it when they start
    (:mod:`mcore_rl.rewards.pool`), so the parts of math-verify and SymPy built on first use
    (the LaTeX parser, percentages, numeric and symbolic comparison: 20-400 ms each on first
    use, then under 10 ms a response, bench/reward_wait.py) are built before the first step
    rather than on some response of a later step, in each process. Rewards are pure functions
    of their texts, so they are the same after it (tests/test_reward_pool.py)."""
    for answer in WARM_UP_ANSWERS:
        example = Example(prompt="", answer=answer, solution=answer, source="math.warm_up")
        for response in WARM_UP_RESPONSES:
            math_reward(response, example)


math_reward.warm_up = warm_up
