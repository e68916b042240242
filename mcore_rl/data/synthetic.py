"""Synthetic integer arithmetic task: prompts ``"23+45="``, answer ``"68"``.

The prompt space is every ``a op b`` with ``a, b`` in ``[min_value, max_value]`` and ``op`` one
of ``operations``. ``num_train + num_test`` distinct prompts are drawn from it without
replacement with ``random.Random(seed)``; the first ``num_test`` form the test split and the
rest the train split, so the splits are disjoint and the same seed gives the same splits.
"""

from __future__ import annotations

import operator
import random
from typing import List, Tuple

from mcore_rl.config.schema import SyntheticTaskConfig
from mcore_rl.data.example import Example

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def make_synthetic_examples(cfg: SyntheticTaskConfig,
                            seed: int) -> Tuple[List[Example], List[Example]]:
    """Train and test examples of the arithmetic task.

    Each example has ``prompt = f"{a}{op}{b}="``, ``answer = solution = str(a op b)`` and
    ``source = "synthetic:<split>:<index>"``.

    Args:
        cfg: ``data.synthetic``.
        seed: the run seed; the splits are a deterministic function of ``(cfg, seed)``.

    Returns:
        ``(train, test)`` with ``num_train`` and ``num_test`` examples and no prompt in both.

    Raises:
        ValueError: ``data.synthetic.operations`` is empty, repeats a character or has one
            outside ``+-*``; ``min_value > max_value``; ``num_train < 1`` or ``num_test < 0``;
            or fewer than ``num_train + num_test`` distinct prompts exist.
    """
    ops = cfg.operations
    bad = sorted(set(ops) - set(OPERATIONS))
    if not ops or bad or len(set(ops)) != len(ops):
        raise ValueError(
            f"data.synthetic.operations={ops!r}: expected distinct characters from "
            f"{''.join(OPERATIONS)!r}" + (f" (unknown: {bad})" if bad else ""))
    if cfg.min_value > cfg.max_value:
        raise ValueError(f"data.synthetic.min_value={cfg.min_value} is larger than "
                         f"data.synthetic.max_value={cfg.max_value}")
    if cfg.num_train < 1 or cfg.num_test < 0:
        raise ValueError(f"data.synthetic.num_train={cfg.num_train} must be positive and "
                         f"data.synthetic.num_test={cfg.num_test} not negative")
    num_values = cfg.max_value - cfg.min_value + 1
    space = len(ops) * num_values * num_values
    wanted = cfg.num_train + cfg.num_test
    if wanted > space:
        raise ValueError(
            f"data.synthetic.num_train + data.synthetic.num_test = {cfg.num_train} + "
            f"{cfg.num_test} = {wanted} exceeds the {space} distinct prompts of operations "
            f"{ops!r} over [{cfg.min_value}, {cfg.max_value}]")

    def example(index: int, split: str, position: int) -> Example:
        op_index, rest = divmod(index, num_values * num_values)
        a, b = (cfg.min_value + v for v in divmod(rest, num_values))
        op = ops[op_index]
        answer = str(OPERATIONS[op](a, b))
        return Example(prompt=f"{a}{op}{b}=", answer=answer, solution=answer,
                       source=f"synthetic:{split}:{position}")

    drawn = random.Random(seed).sample(range(space), wanted)
    test = [example(i, "test", k) for k, i in enumerate(drawn[:cfg.num_test])]
    train = [example(i, "train", k) for k, i in enumerate(drawn[cfg.num_test:])]
    return train, test
