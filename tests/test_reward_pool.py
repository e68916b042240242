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
    "hang", 3 s on "slow", kills its process on "die", raises on "raise", else scores
    exactly."""
    if response == "hang":
        time.sleep(3600)
    if response == "slow":
        time.sleep(3)
    if response == "die":
        os._exit(3)
    if response == "raise":
        raise RuntimeError("verifier bug")
    return exact_reward(response, example)


def _ex(answer: str) -> Example:
    return Example(prompt="q", answer=answer, solution=answer, source=f"t.jsonl:{answer}")


_WARMED = False  # set in a pool process by _warm (its warm_up)


def _warm() -> None:
    global _WARMED
    _WARMED = True


def warmed(response: str, example: Example) -> float:
    """A reward (module level) that scores 1 in a process whose ``warm_up`` ran, else 0."""
    return float(_WARMED)


warmed.warm_up = _warm


def _raise() -> None:
    raise RuntimeError("warm-up bug")


def exact_badly_warmed(response: str, example: Example) -> float:
    """:func:`exact_reward` with a ``warm_up`` that raises."""
    return exact_reward(response, example)


exact_badly_warmed.warm_up = _raise

# A 135M model's GSM8K responses (bench/reward_wait.py has more): a 256-token ramble cut off
# mid-sentence with numbers and no answer, LaTeX fragments, a percentage, emoji, symbols.
MODEL_LIKE = [
    "Natalia sold 48 clips in April. In May she sold half, 48/2 = 24. So 48 + 24 = 7",
    "To find 2, 3, 4, 6, 8, 12, 16, 2, 4, 8, leave (n) to 8.\nLet's find 1-8. We will use 4.\n"
    "Let's put 1-4 in 8. So 6 + 4 = 10. So we have",
    "Or 1.5% to   Multiple simpler switch and some different approach.",
    "The answer is: \U0001f3ad\U0001f3af\nNo, buttons. It is",
    "We want to find An * 8.\nAn = 2*8 = 16.\nAn = 4A.\nBut we need 16 + An = 4A.",
    "So the total is $\\frac{48}{2} + 48 = \\boxed{72}$",
    "In April she sold 710 CLIPS as a fraction + 170/333 = 72%.",
    "x = 5 \u2234 \u221a25 \u2248 5",
]


def test_pool_rewards_equal_serial_rewards_on_gsm8k_answers():
    examples = [ex for split in ("train", "test")
                for ex in load_gsm8k(GSM8K_SAMPLE_DIR / f"{split}.jsonl")]
    # Right, wrong (the next example's solution), free-form and model-like answers; the pool's
    # processes warmed up (math_reward.warm_up), the serial scoring not.
    responses = ([ex.solution for ex in examples] + [b.solution for b in examples[1:]]
                 + [f"The answer is {ex.answer}." for ex in examples] + MODEL_LIKE)
    targets = examples + examples[:-1] + examples + examples[:len(MODEL_LIKE)]
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


def test_pool_processes_run_the_rewards_warm_up(capfd):
    """Each pool process runs each plain reward's warm_up before its first sample; one that
    raises is reported and skipped (the pool scores as without it); without warm_workers none
    runs."""
    from mcore_rl.rewards import RewardComponent
    from mcore_rl.rewards.pool import _start_worker

    components = [RewardComponent("warmed", warmed, 1.0, "reward/warmed"),
                  RewardComponent("exact", exact_badly_warmed, 1.0, "reward/exact")]
    scorer = RewardScorer(components, num_workers=2, timeout_seconds=60)
    examples = [_ex(str(i)) for i in range(6)]
    try:
        pending = scorer.submit([str(i) for i in range(5)] + ["9"], examples)
        rewards, errors, _ = pending.result()
    finally:
        scorer.close()
    assert pending.components()["reward/warmed"].tolist() == [1.0] * 6
    assert rewards.tolist() == [2.0] * 5 + [1.0] and errors == 0 and scorer.pools_made == 1
    assert "exact_badly_warmed.warm_up raised RuntimeError('warm-up bug')" in capfd.readouterr().err
    _start_worker((warmed,), False)  # here: warm_workers=False calls no warm_up
    assert not _WARMED


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
    # the hung worker's pool was replaced twice: its task of 3 samples passed its deadline
    # (which of them hung is not known), then the hung sample alone
    assert scorer.pools_made == 3
    assert after.tolist() == [1.0] and after_errors == 0


def test_samples_go_in_tasks_each_with_its_own_deadline():
    """The waiting samples go to the free workers in tasks of up to MAX_CHUNK: a sample past
    its own limit inside a task that finished scores 0 and counts an error, as alone (its
    pool is not replaced: nothing hung); the task's others score."""
    from mcore_rl.rewards.pool import MAX_CHUNK, _take

    todo = list(range(20, 0, -1))  # a stack: 1 is next
    assert _take(todo, set(), 4) == [1, 2, 3, 4, 5]  # 20 spread over 4 free workers
    assert len(_take(list(range(100)), set(), 1)) == MAX_CHUNK
    assert _take([7, 8, 9], {8}, 2) == [9]  # stops before a suspect
    assert _take([7, 8, 9], {9}, 2) == [9]  # which runs alone
    examples = [_ex(str(i)) for i in range(3)]
    scorer = RewardScorer(hangs_or_dies, num_workers=1, timeout_seconds=2)
    try:
        rewards, errors, busy = scorer.score(["0", "slow", "2"], examples)
    finally:
        scorer.close()
    assert rewards.tolist() == [1.0, 0.0, 1.0]
    assert errors == 1 and scorer.pools_made == 1


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
