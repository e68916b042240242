"""Reward verifiers and batch scoring."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from mcore_rl.config.schema import SyntheticTaskConfig
from mcore_rl.data.example import Example
from mcore_rl.data.gsm8k import GSM8K_SAMPLE_DIR, load_gsm8k
from mcore_rl.data.synthetic import make_synthetic_examples
from mcore_rl.rewards import get_reward_fn, score_responses


def _ex(answer: str) -> Example:
    return Example(prompt="q", answer=answer, solution=answer, source="t.jsonl:3")


@pytest.mark.parametrize("response,answer,reward", [
    ("The answer is 72.", "72", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("So she has 1,000 apples.\n#### 1000\n\nQuestion: 3 more", "1000", 1.0),
    ("48/2 = 24 clips in May, 48+24 = 72 in all.\nThe answer is 72.", "72", 1.0),
    ("The final answer is $\\boxed{18}$", "18", 1.0),
    ("The answer is 0.5", "1/2", 1.0),
    ("The answer is 71.", "72", 0.0),
    ("#### 5\nThe answer is 72.", "72", 0.0),  # the first "####" answer is the one that counts
    ("garbage !!", "72", 0.0),
    ("", "72", 0.0),
])
def test_math_verifier(response, answer, reward):
    assert get_reward_fn("math")(response, _ex(answer)) == reward


def test_math_verifier_outside_main_thread():
    # math-verify's signal-based timeouts fail off the main thread; the verifier turns them off.
    results = []
    thread = threading.Thread(target=lambda: results.append(
        get_reward_fn("math")("The answer is 72.", _ex("72"))))
    thread.start()
    thread.join()
    assert results == [1.0]


def test_math_verifier_on_reference_solutions():
    examples = [ex for split in ("train", "test")
                for ex in load_gsm8k(GSM8K_SAMPLE_DIR / f"{split}.jsonl")]
    fn = get_reward_fn("math")
    assert all(fn(ex.solution, ex) == 1.0 for ex in examples)
    shifted = [(a, b) for a, b in zip(examples, examples[1:]) if a.answer != b.answer]
    assert all(fn(a.solution, b) == 0.0 for a, b in shifted)


def _typical_responses(ex: Example, other: str):
    """A GSM8K example's reference solution and model-like answers to it: right and wrong, with
    units, ``$``, thousands commas, trailing text, ``####`` lines, no number at all."""
    n = ex.answer
    big = f"{int(n):,}" if n.lstrip("-").isdigit() else n
    return [ex.solution, f"#### {n}", f"#### ${big} dollars", f"So the total is {big} apples.",
            f"The answer is {other}.", f"{n} + 1 = {other}, so she has {other} left.",
            f"#### {other}\nThe answer is {n}.", f"\\boxed{{{n}}}", "I am not sure.", ""]


def test_math_verifier_keeps_the_parsed_ground_truth(monkeypatch):
    """Each answer is parsed once per process (then kept), and every reward is the one of
    math-verify parsing both texts afresh, on the package's GSM8K examples and model-like
    responses."""
    from math_verify import parse, verify

    from mcore_rl.rewards import math as math_module

    examples = [ex for split in ("train", "test")
                for ex in load_gsm8k(GSM8K_SAMPLE_DIR / f"{split}.jsonl")]
    math_module._parsed_gold.cache_clear()
    parsed = []
    monkeypatch.setattr(math_module, "parse", lambda text, **kw: parsed.append(text) or parse(text, **kw))
    fn, rewards = get_reward_fn("math"), []
    for ex, nxt in zip(examples, examples[1:] + examples[:1]):
        for response in _typical_responses(ex, nxt.answer if nxt.answer != ex.answer else "7"):
            got = fn(response, ex)
            _, sep, after = response.partition("####")
            candidate = after.split("\n", 1)[0] if sep else response
            assert got == float(verify(parse(ex.answer), parse(candidate))), (response, ex.answer)
            rewards.append(got)
    # no candidate text is a bare answer (they carry a space, words or LaTeX): these are the
    # ground-truth parses, one per distinct answer over all its responses
    answers = {ex.answer for ex in examples}
    assert sorted(t for t in parsed if t in answers) == sorted(answers)
    assert 0.3 < sum(rewards) / len(rewards) < 0.7  # both outcomes, in numbers


def test_math_warm_up_runs_and_leaves_the_rewards_alone(caplog):
    """math_reward.warm_up (each reward-pool process calls it at start) raises nothing, times
    out nothing, and the rewards after it are those before it."""
    from mcore_rl.rewards import math as math_module

    examples = load_gsm8k(GSM8K_SAMPLE_DIR / "train.jsonl")[:4]
    cases = [(r, ex) for ex in examples for r in (*_typical_responses(ex, "7"),
                                                   *math_module.WARM_UP_RESPONSES)]
    before = [math_module.math_reward(r, ex) for r, ex in cases]
    assert math_module.math_reward.warm_up is math_module.warm_up
    with caplog.at_level(logging.WARNING):
        math_module.warm_up()
    assert "Timeout" not in caplog.text
    assert [math_module.math_reward(r, ex) for r, ex in cases] == before


@pytest.mark.parametrize("response,reward", [
    ("68", 1.0), (" 68\n1+2=", 1.0), ("068", 1.0),
    ("67", 0.0), ("68 1", 0.0), ("+68", 0.0), ("68.0", 0.0), ("sixty-eight", 0.0), ("", 0.0),
])
def test_exact_verifier(response, reward):
    assert get_reward_fn("exact")(response, _ex("68")) == reward


def test_exact_verifier_negative_answers_and_reference_solutions():
    assert get_reward_fn("exact")("-12", _ex("-12")) == 1.0
    cfg = SyntheticTaskConfig(operations="+-*", num_train=200, num_test=0)
    train, _ = make_synthetic_examples(cfg, seed=0)
    assert all(get_reward_fn("exact")(ex.solution, ex) == 1.0 for ex in train)
    with pytest.raises(ValueError, match=r"t\.jsonl:3: answer '7\.5' is not an integer"):
        get_reward_fn("exact")("7", _ex("7.5"))


def test_unknown_reward_name():
    with pytest.raises(ValueError, match=r"reward\.name='bleu'"):
        get_reward_fn("bleu")


def test_score_responses_counts_errors_and_warns_once(caplog):
    def flaky(response: str, example: Example) -> float:
        if response == "boom":
            raise RuntimeError("verifier crashed")
        return get_reward_fn("exact")(response, example)

    examples = [_ex("1"), _ex("2"), _ex("3"), _ex("4")]
    with caplog.at_level(logging.WARNING, logger="mcore_rl.rewards"):
        rewards, num_errors = score_responses(flaky, ["1", "boom", "3", "5"], examples)
    assert rewards.dtype == torch.float32 and rewards.shape == (4,)
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert num_errors == 1
    warnings = [r for r in caplog.records if r.name == "mcore_rl.rewards"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "1 of 4" in warnings[0].getMessage() and "verifier crashed" in warnings[0].getMessage()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mcore_rl.rewards"):
        rewards, num_errors = score_responses(flaky, ["1", "2"], examples[:2])
    assert rewards.tolist() == [1.0, 1.0] and num_errors == 0 and not caplog.records
    with pytest.raises(ValueError, match="2 responses for 1 examples"):
        score_responses(flaky, ["1", "2"], examples[:1])
