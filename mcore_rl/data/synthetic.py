"""Synthetic integer arithmetic task: prompts ``"23+45="``, answer ``"68"``.

The prompt space is every ``a op b`` with ``a, b`` in ``[min_value, max_value]`` and ``op`` one
of ``operations``. ``num_train + num_test`` distinct prompts are drawn from it without
replacement with ``random.Random(seed)``; the first ``num_test`` form the test split and the
rest the train split, so the splits are disjoint and the same seed gives the same splits.
"""

from __future__ import annotations

import dataclasses
import operator
import random
from typing import TYPE_CHECKING, List, Tuple

from mcore_rl.config.checks import ConfigError, errors
from mcore_rl.config.schema import SyntheticTaskConfig
from mcore_rl.data.example import Example

if TYPE_CHECKING:
    from mcore_rl.config.schema import DataConfig

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def synthetic_config_errors(cfg: SyntheticTaskConfig) -> List[str]:
    """Why ``data.synthetic`` (``cfg``) cannot make its splits beyond its keys' declared bounds,
    one message per problem naming its keys; empty when it can. Checked by config validation
    and :func:`make_synthetic_examples`: ``operations`` empty, repeating a character or with
    one outside ``+-*``; ``min_value > max_value``; fewer than ``num_train + num_test``
    distinct prompts."""
    ops, out = cfg.operations, []
    bad = sorted(set(ops) - set(OPERATIONS))
    if not ops or bad or len(set(ops)) != len(ops):
        out.append(f"data.synthetic.operations={ops!r}: expected distinct characters from "
                   f"{''.join(OPERATIONS)!r}" + (f" (unknown: {bad})" if bad else ""))
    if cfg.min_value > cfg.max_value:
        out.append(f"data.synthetic.min_value={cfg.min_value} is larger than "
                   f"data.synthetic.max_value={cfg.max_value}")
    elif not out and cfg.num_train + cfg.num_test > _num_prompts(cfg):
        out.append(f"data.synthetic.num_train + data.synthetic.num_test = {cfg.num_train} + "
                   f"{cfg.num_test} = {cfg.num_train + cfg.num_test} exceeds the "
                   f"{_num_prompts(cfg)} distinct prompts of operations {ops!r} over "
                   f"[{cfg.min_value}, {cfg.max_value}]")
    return out


def _num_prompts(cfg: SyntheticTaskConfig) -> int:
    """Size of the prompt space: operations x values^2."""
    return len(cfg.operations) * (cfg.max_value - cfg.min_value + 1) ** 2


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
        ConfigError: a key outside its declared bounds (``num_train >= 1``, ``num_test >= 0``)
            or a problem of :func:`synthetic_config_errors`, ``"; "``-joined.
    """
    problems = errors(cfg, "data.synthetic") + synthetic_config_errors(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    ops, num_values = cfg.operations, cfg.max_value - cfg.min_value + 1

    def example(index: int, split: str, position: int) -> Example:
        op_index, rest = divmod(index, num_values * num_values)
        a, b = (cfg.min_value + v for v in divmod(rest, num_values))
        op = ops[op_index]
        answer = str(OPERATIONS[op](a, b))
        return Example(prompt=f"{a}{op}{b}=", answer=answer, solution=answer,
                       source=f"synthetic:{split}:{position}")

    drawn = random.Random(seed).sample(range(_num_prompts(cfg)), cfg.num_train + cfg.num_test)
    test = [example(i, "test", k) for k, i in enumerate(drawn[:cfg.num_test])]
    train = [example(i, "train", k) for k, i in enumerate(drawn[cfg.num_test:])]
    if cfg.tool_solutions > 0:
        pick = random.Random(seed + 1)
        train = [dataclasses.replace(ex, solution=calculator_solution(ex))
                 if pick.random() < cfg.tool_solutions else ex for ex in train]
    return train, test


def calculator_solution(example: Example, eos: str = "<eos>") -> str:
    """A reference episode of ``env.name=tool_use`` for ``example`` in plain text (the character
    tokenizer, whose ``eos`` text encodes to its eos id): the model's calculator call in the
    Hermes format (:mod:`mcore_rl.environments.tools`), eos (the end of its turn), the
    observation as the multi-turn loop appends it (the tool's response and a newline), and the
    answer (the trainer appends the last eos). ``tests/test_multi_turn.py`` checks it against
    the loop's own tokens."""
    expression = example.prompt.rstrip("=")
    call = ('<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
            % expression)
    response = '<tool_response>\n{"result": %s}\n</tool_response>\n' % example.answer
    return call + eos + response + example.answer


def task_errors(data: "DataConfig") -> List[str]:
    """The load-time check of ``data.task=synthetic`` (its entry in
    :data:`mcore_rl.config.registry.TASKS`), one message per problem naming its keys: no data
    paths nor ``data.test_fraction``, and :func:`synthetic_config_errors` of
    ``data.synthetic``."""
    paths = ["data.train_path and data.test_path must be null for data.task=synthetic (its "
             "prompts come from data.synthetic)"] if data.train_path or data.test_path else []
    if data.test_fraction > 0:
        paths.append(f"data.test_fraction={data.test_fraction} is for data read from files; "
                     f"data.task=synthetic holds out data.synthetic.num_test prompts")
    return paths + synthetic_config_errors(data.synthetic)


def task_examples(data: "DataConfig", seed: int) -> Tuple[List[Example], List[Example]]:
    """``data.task=synthetic``: :func:`make_synthetic_examples` of ``data.synthetic`` and
    ``seed`` (no validation set when ``num_test`` is 0)."""
    return make_synthetic_examples(data.synthetic, seed)
