"""Reward scoring in a process pool (mcore_rl/rewards/pool.py): same rewards as in the
controller, hung and dead workers scored 0 and counted without stopping the scoring."""

from __future__ import annotations

import os
import time

import pytest
import torch

from mcore_rl.data.example import Example
from mcore_rl.data.gsm8k import GSM8K_SAMPLE_DIR, load_gsm8k
from mcore_rl.rewards import get_reward_fn, score_responses
from mcore_rl.rewards.exact import exact_reward
from mcore_rl.rewards.math import math_reward
from mcore_rl.rewards.pool import RewardScorer, default_num_workers


def hangs_or_dies(response: str, example: Example) -> float:
    """A verifier (module level: the pool's processes import it) that sleeps an hour on
    "hang", kills its process on "die", raises on "raise", else scores exactly."""
    if response == "hang":
        time.sleep(3600)
    if response == "die":
        os._exit(3)
    if response == "raise":
        raise RuntimeError("verifier bug")
    return exact_reward(response, example)


def _ex(answer: str) -> Example:
    return Example(prompt="q", answer=answer, solution=answer, source=f"t.jsonl:{answer}")


def test_pool_rewards_equal_serial_rewards_on_gsm8k_answers():
    examples = [ex for split in ("train", "test")
                for ex in load_gsm8k(GSM8K_SAMPLE_DIR / f"{split}.jsonl")]
    # Right, wrong (the next example's solution), and free-form answers.
    responses = ([ex.solution for ex in examples] + [b.solution for b in examples[1:]]
                 + [f"The answer is {ex.answer}." for ex in examples])
    targets = examples + examples[:-1] + examples
    serial, serial_errors = score_responses(math_reward, responses, targets)
    scorer = RewardScorer(math_reward, num_workers=2, timeout_seconds=60)
    try:
        pending = scorer.submit(responses, targets)  # returns before the scoring is done
        rewards, errors, busy = pending.result()
        again, _, _ = scorer.score(responses[:3], targets[:3])  # the pool is reused
    finally:
        scorer.close()
    assert rewards.dtype == torch.float32 and torch.equal(rewards, serial)
    assert errors == serial_errors == 0 and busy > 0
    assert 0 < float(rewards.mean()) < 1  # both right and wrong answers in the set
    assert torch.equal(again, serial[:3]) and scorer.pools_made == 1


def test_hung_verification_scores_zero_and_counts_an_error():
    examples = [_ex(str(i)) for i in range(6)]
    responses = ["0", "hang", "2", "raise", "9", "5"]
    scorer = RewardScorer(hangs_or_dies, num_workers=2, timeout_seconds=2)
    try:
        rewards, errors, _ = scorer.score(responses, examples)
        # The new pool works: a quick sample, with a deadline no loaded machine misses (2 s
        # did once, at load average 8 on 2 cores, and counted a third pool)
        scorer.timeout_seconds = 120.0
        after, after_errors, _ = scorer.score(["1"], examples[1:2])
    finally:
        scorer.close()
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert errors == 2  # the hang and the raise; "9" is just wrong
    assert scorer.pools_made == 2  # the hung worker's pool was replaced
    assert after.tolist() == [1.0] and after_errors == 0


def test_dead_worker_does_not_stop_the_scoring():
    examples = [_ex(str(i)) for i in range(5)]
    responses = ["0", "1", "die", "3", "4"]
    scorer = RewardScorer(hangs_or_dies, num_workers=2, timeout_seconds=60)
    try:
        rewards, errors, _ = scorer.score(responses, examples)
    finally:
        scorer.close()
    # "die" kills a worker each time it is tried: it scores 0 after its last try; the samples
    # in flight beside it are tried again and score right.
    assert rewards.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert errors == 1 and scorer.pools_made >= 2


def test_worker_dead_between_calls_is_replaced():
    scorer = RewardScorer(hangs_or_dies, num_workers=1, timeout_seconds=60)
    try:
        assert scorer.score(["1"], [_ex("1")])[0].tolist() == [1.0]
        for proc in list(scorer._pool._processes.values()):  # killed while idle
            proc.kill()
            proc.join()
        rewards, errors, _ = scorer.score(["1", "2"], [_ex("1"), _ex("2")])
    finally:
        scorer.close()
    assert rewards.tolist() == [1.0, 1.0] and errors == 0 and scorer.pools_made == 2


def test_in_process_scoring_and_bad_arguments():
    scorer = RewardScorer(get_reward_fn("exact"), num_workers=0)
    rewards, errors, busy = scorer.score(["1", "x"], [_ex("1"), _ex("2")])
    assert rewards.tolist() == [1.0, 0.0] and errors == 0 and busy >= 0
    assert scorer.pools_made == 0
    with pytest.raises(ValueError, match="2 responses for 1 examples"):
        scorer.submit(["1", "2"], [_ex("1")])
    with pytest.raises(ValueError, match=r"reward\.num_workers=-1"):
        RewardScorer(exact_reward, num_workers=-1)
    with pytest.raises(ValueError, match=r"reward\.timeout_seconds=0"):
        RewardScorer(exact_reward, timeout_seconds=0)
    assert default_num_workers("exact") == 0
    assert 1 <= default_num_workers("math") <= 8


def length_bonus(responses, examples):
    """A batched reward (module level): 0.1 per word, at most 1."""
    return [min(1.0, 0.1 * len(r.split())) for r in responses]


length_bonus.batched = True


@pytest.mark.parametrize("num_workers", [2, 0])
def test_rows_scored_as_they_arrive_equal_scoring_after(num_workers):
    """reward.score_while_decoding: a rollout's rows handed over in pieces, out of order and
    with pauses (StreamingRewards), score exactly as the whole rollout submitted at once, with
    a plain reward (in the pool, or in the caller without one) and a batched one (the whole
    rollout at close); the pool scores the rows it has while more are to come."""
    from mcore_rl.rewards import RewardComponent

    examples = load_gsm8k(GSM8K_SAMPLE_DIR / "train.jsonl")[:12]
    responses = ([ex.solution for ex in examples[:6]] + [f"The answer is {ex.answer}." for ex in
                                                         examples[6:9]]
                 + ["no idea", "raise", "12"])
    components = [RewardComponent("math", math_reward, 1.0, "reward/math"),
                  RewardComponent("bonus", length_bonus, 0.5, "reward/bonus")]
    scorer = RewardScorer(components, num_workers=num_workers, timeout_seconds=60)
    try:
        whole = scorer.submit(responses, examples)
        expected, expected_errors, _ = whole.result()
        stream = scorer.open(examples)
        order = [[5, 0], [11, 3, 7], [1, 2, 4, 6, 8], [9, 10]]
        for rows in order[:-1]:
            stream.add(rows, [responses[i] for i in rows])
        deadline = time.monotonic() + 60  # the pool scores what it has before the last rows
        while num_workers and stream._scored < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        stream.add(order[-1], [responses[i] for i in order[-1]])
        with pytest.raises(ValueError, match="added twice"):
            stream.add([0], ["again"])
        stream.close()
        rewards, errors, busy = stream.result()
        components_of = stream.components()
    finally:
        scorer.close()
    assert torch.equal(rewards, expected) and errors == expected_errors and busy > 0
    for metric, values in whole.components().items():
        assert torch.equal(components_of[metric], values), metric
    assert float(expected.max()) > 1.0 > float(expected.min())  # right and wrong answers
    assert stream.early_fraction == (10 / 12 if num_workers else 1.0)


def test_streamed_rollout_missing_rows_or_cancelled_raises():
    scorer = RewardScorer(exact_reward, num_workers=0)
    stream = scorer.open([_ex("1"), _ex("2")])
    stream.add([1], ["2"])
    with pytest.raises(ValueError, match=r"rows \[0\] were never added"):
        stream.close()
    with pytest.raises(RuntimeError, match="cancelled"):
        stream.result()
