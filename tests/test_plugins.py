"""Your data, your reward, your environment (issue 35), with no edit to the package: a package
outside ``mcore_rl`` (``userpkg``, written to a temporary directory put on ``sys.path`` and
``PYTHONPATH``) provides rewards (plain, async, batched), an environment, a prompt task, an
advantage estimator and a policy loss, named by import path; the generic data set reads its
data in every format. Bad input exits 2 with one line naming the key, the file and row, or the
function."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mcore_rl.cli import main
from mcore_rl.config import ConfigError
from mcore_rl.config.loader import load_config
from mcore_rl.config.schema import DataConfig, RewardConfig
from mcore_rl.data.dataset import hold_out, task_examples
from mcore_rl.data.example import Example
from mcore_rl.data.gsm8k import GSM8K_SAMPLE_DIR, load_gsm8k
from mcore_rl.data.prompts import PromptDataset, load_task
from mcore_rl.data.tokenizer import build_char_tokenizer

USER_FILES = {
    "userpkg/__init__.py": "",
    "userpkg/rewards.py": '''
import asyncio


def correct(response, example):
    return float(response.split("\\n", 1)[0].strip() == example.answer)


def brevity(response, example):
    return 1.0 / (1 + len(response))


def level(response, example):
    return float(example.fields["level"])


async def remote(response, example):
    await asyncio.sleep(0.001)
    return 0.5 if response.startswith("1") else -0.5


async def stalls(response, example):
    await asyncio.sleep(0 if response else 60)
    return 1.0


def parity(responses, examples):
    return [float(len(r) % 2) for r in responses]


parity.batched = True


def flaky(response, example):
    if response == "boom":
        raise RuntimeError("scorer down")
    return 1.0


def needs_column(response, example):
    return float(example.fields["difficulty"])


def one_argument(response):
    return 0.0
''',
    "userpkg/envs.py": '''
from dataclasses import dataclass
from typing import Callable

from mcore_rl.environments.base import StepResult
from mcore_rl.rewards import build_reward


@dataclass(frozen=True)
class AnswerOnce:
    """One model turn, scored by the run's reward (reward.name or reward.names)."""

    reward: Callable

    @classmethod
    def from_config(cls, cfg):
        return cls(build_reward(cfg.reward))

    def reset(self, example):
        return None, {"turns": 0}

    def step(self, state, text):
        return StepResult(None, float(self.reward(text, state.example)), True,
                          {"turns": state.turn + 1})


class NoStep:
    @classmethod
    def from_config(cls, cfg):
        return cls()

    def reset(self, example):
        return None, {}


class PlainFromConfig(AnswerOnce):
    def from_config(self, cfg):
        return self
''',
    "userpkg/tasks.py": '''
from mcore_rl.data.example import Example


def arithmetic(data, seed):
    examples = [Example(f"{a}+{b}=", str(a + b), str(a + b), f"user:{a}:{b}")
                for a in range(5) for b in range(5)]
    return examples[5:], examples[:5]


def rows(data, seed):
    return [{"prompt": "1+1=", "answer": "2"}], []
''',
    "userpkg/algos.py": '''
from mcore_rl.algorithms.estimators import grpo
from mcore_rl.algorithms.losses import ClippedPGLoss


def centered(rollout, cfg):
    return grpo(rollout, cfg)


centered.per_group = True


def whole_batch(rollout, cfg):
    return grpo(rollout, cfg)


class MyClip(ClippedPGLoss):
    pass


class Untyped:
    def __init__(self, config, max_response_length=None):
        pass

    def __call__(self, logprobs, batch):
        return logprobs.sum(), 1, {}


class Broken(ClippedPGLoss):
    def __init__(self, config, max_response_length=None):
        raise ValueError("needs loss.ratio_clip_low < 0.1")
''',
    "userpkg/broken.py": "import not_a_package_anywhere\n",
}

# An arithmetic data set with an extra column ("level") that reaches the reward.
ROWS = [{"question": f"{a}+{b}=", "sum": a + b, "level": a % 3} for a in range(6) for b in range(5)]
FORMATS = ("jsonl", "json", "parquet", "saved", "saved_dict")


@pytest.fixture(scope="module")
def userpkg(tmp_path_factory):
    """The user's package on ``sys.path`` and ``PYTHONPATH`` (the processes a run spawns)."""
    root = tmp_path_factory.mktemp("user")
    for name, text in USER_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    old = os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root)] + ([old] if old else []))
    yield root
    sys.path.remove(str(root))
    for module in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
        del sys.modules[module]
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old


def write_dataset(root: Path, fmt: str, rows, name: str = "data") -> Path:
    """``rows`` written in format ``fmt`` under ``root``; returns the path to name."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    if fmt == "jsonl":
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path = root / f"{name}.json"
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        path = root / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "saved":
        path = root / name
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    else:  # a DatasetDict: the train path takes "train", the test path "test"
        path = root / name
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                              "test": datasets.Dataset.from_list(rows[:4])}).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    """:data:`ROWS` in every format, by format."""
    root = tmp_path_factory.mktemp("data")
    return {fmt: write_dataset(root, fmt, ROWS, f"arith_{fmt}") for fmt in FORMATS}


def _data(path, **changes) -> DataConfig:
    return replace(DataConfig(task="dataset", train_path=str(path), prompt_key="question",
                              answer_key="sum"), **changes)


# ---------------------------------------------------------------------------- data sets

@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_gives_the_rows_as_examples(data_files, fmt):
    train, test = task_examples(_data(data_files[fmt]), seed=0)
    assert test == []
    assert [ex.prompt for ex in train] == [r["question"] for r in ROWS]
    assert [ex.answer for ex in train] == [str(r["sum"]) for r in ROWS]  # numbers as text
    assert [ex.solution for ex in train] == [ex.answer for ex in train]
    assert [ex.fields for ex in train] == [{"level": r["level"]} for r in ROWS]  # passed through
    first = {"jsonl": ":1", "json": ": row 0", "parquet": ": row 0", "saved": ": row 0",
             "saved_dict": "[train]: row 0"}[fmt]
    assert train[0].source == f"{data_files[fmt]}{first}"


def test_test_split_by_file_and_by_seeded_fraction(data_files):
    _, test = task_examples(_data(data_files["saved_dict"], test_path=str(data_files["saved_dict"])),
                            seed=0)
    assert [ex.prompt for ex in test] == [r["question"] for r in ROWS[:4]]  # the "test" split
    _, by_file = task_examples(_data(data_files["jsonl"], test_path=str(data_files["parquet"])), 0)
    assert len(by_file) == len(ROWS)
    data = _data(data_files["parquet"], test_fraction=0.2)
    train, test = task_examples(data, seed=7)
    assert (len(train), len(test)) == (24, 6)
    assert sorted(ex.source for ex in train + test) == sorted(f"{data_files['parquet']}: row {i}"
                                                              for i in range(len(ROWS)))
    assert task_examples(data, seed=7) == (train, test)  # the seed fixes the split
    assert task_examples(data, seed=8)[1] != test
    assert task_examples(replace(data, split_seed=7), seed=123) == (train, test)  # split_seed wins
    # the rows of each split keep their file order
    rows = [int(ex.source.rsplit(" ", 1)[1]) for ex in test]
    assert rows == sorted(rows)
    with pytest.raises(ConfigError, match=r"data\.test_fraction=0\.99 holds out 3 of the 3 rows"):
        hold_out(train[:3], 0.99, seed=0)


def test_chat_messages_and_system_prompt_are_rendered(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be exact."},
                          {"role": "user", "content": "2+3="}], "answer": "5", "id": 7},
            {"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "id": 8}]
    path = write_dataset(tmp_path, "jsonl", rows)
    data = DataConfig(task="dataset", train_path=str(path), messages_key="messages",
                      system_prompt="Answer with a number.")
    train, _ = task_examples(data, seed=0)
    assert [ex.prompt for ex in train] == ["2+3=", "1+1="]  # the last user turn
    assert train[0].messages[0] == {"role": "system", "content": "Be exact."}
    assert [ex.fields for ex in train] == [{"id": 7}, {"id": 8}]
    tok = build_char_tokenizer()
    plain = PromptDataset(train, tok, max_prompt_length=64, system_prompt=data.system_prompt)
    # without a chat template: the contents, one a line; the row's own system turn is kept
    assert plain.texts == ["Be exact.\n2+3=", "Answer with a number.\n1+1="]
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = PromptDataset(train, tok, use_chat_template=True, max_prompt_length=64,
                         system_prompt=data.system_prompt)
    assert chat.texts == ["<system>Be exact.\n<user>2+3=\n<assistant>",
                          "<system>Answer with a number.\n<user>1+1=\n<assistant>"]
    # plain prompts get the system prompt as their first line too
    one = [Example("4+4=", "8", "8", "t:1")]
    assert PromptDataset(one, build_char_tokenizer(), "Q: {question}", max_prompt_length=64,
                         system_prompt="Hi.").texts == ["Hi.\nQ: 4+4="]


def test_long_prompts_are_dropped_and_counted_or_refused(data_files, caplog):
    rows = ROWS + [{"question": "100+1=", "sum": 101, "level": 0},
                   {"question": "1+100=", "sum": 101, "level": 0}]  # 6 characters: too long
    path = write_dataset(Path(data_files["jsonl"]).parent, "jsonl", rows, "with_long")
    data, tok = _data(path, max_prompt_length=4), build_char_tokenizer()
    with pytest.raises(ConfigError, match=r"with_long\.jsonl:31: prompt is 6 tokens; it must be "
                                          r"1 to data\.max_prompt_length=4 tokens"):
        load_task(data, tok, seed=0)
    with caplog.at_level(logging.WARNING, logger="mcore_rl.data"):
        train, test = load_task(replace(data, filter_long_prompts=True, test_fraction=0.5), tok,
                                seed=3)
    dropped = {"training": train.dropped, "held-out": test.dropped}
    assert sum(dropped.values()) == 2 and len(train) + len(test) == len(ROWS)
    assert all(len(ids) <= 4 for ids in train.input_ids + test.input_ids)
    messages = [r.getMessage() for r in caplog.records]
    for split, n in dropped.items():  # reported per split, not silent
        if n:
            assert any(f"{n} of the 16 {split} prompts are longer than "
                       f"data.max_prompt_length=4 tokens and were dropped" in m for m in messages)
    with pytest.raises(ConfigError, match="dropped all 2 prompts"):
        PromptDataset([Example(r["question"], "101", "101", "t") for r in rows[-2:]], tok,
                      max_prompt_length=4, filter_long_prompts=True)


def test_gsm8k_is_a_configuration_of_the_generic_data_set(tmp_path):
    from mcore_rl.rewards.math import math_reward

    path = GSM8K_SAMPLE_DIR / "train.jsonl"
    gsm8k = load_gsm8k(path)
    generic, _ = task_examples(DataConfig(task="dataset", train_path=str(path),
                                          prompt_key="question", answer_key="answer"), seed=0)
    assert [ex.prompt for ex in generic] == [ex.prompt for ex in gsm8k]
    assert [ex.source for ex in generic] == [ex.source for ex in gsm8k]
    # the answer parser is the reward's: the raw "... #### N" column scores as the parsed one
    for response in (gsm8k[0].solution, gsm8k[1].solution, "The answer is 12."):
        assert math_reward(response, generic[0]) == math_reward(response, gsm8k[0])
    assert math_reward(gsm8k[0].solution, generic[0]) == 1.0
    # and the gsm8k task reads the generic formats
    rows = [json.loads(line) for line in path.read_text().splitlines()[:5]]
    parquet = write_dataset(tmp_path, "parquet", rows)
    assert [ex.answer for ex in load_gsm8k(parquet)] == [ex.answer for ex in gsm8k[:5]]


# ---------------------------------------------------------------------------- rewards

def test_weighted_rewards_equal_the_hand_weighted_sum(userpkg):
    from mcore_rl.rewards import reward_components
    from mcore_rl.rewards.pool import RewardScorer

    from userpkg import rewards as user

    names = ["exact", "userpkg.rewards:brevity", "userpkg.rewards:level",
             "userpkg.rewards:remote", "userpkg.rewards:parity"]
    weights = [1.0, 0.5, 0.25, 2.0, -1.0]
    components = reward_components(RewardConfig(names=names, weights=weights))
    assert [c.style for c in components] == ["sync", "sync", "sync", "async", "batched"]
    assert [c.metric for c in components] == ["reward/exact", "reward/brevity", "reward/level",
                                              "reward/remote", "reward/parity"]
    examples = [Example(f"{a}+1=", str(a + 1), str(a + 1), f"t:{a}", fields={"level": a % 3})
                for a in range(8)]
    responses = ["1", "3", "x", "4", "5", "16", "7", "88"]
    from mcore_rl.rewards.exact import exact_reward
    import asyncio

    by_hand = [[exact_reward(r, e), user.brevity(r, e), user.level(r, e),
                asyncio.run(user.remote(r, e)), float(len(r) % 2)]
               for r, e in zip(responses, examples)]
    expected = torch.tensor(by_hand, dtype=torch.float64) @ torch.tensor(weights,
                                                                          dtype=torch.float64)
    for workers in (0, 2):  # in the controller; the plain ones in the pool
        scorer = RewardScorer(components, num_workers=workers, timeout_seconds=60)
        try:
            pending = scorer.submit(responses, examples)
            rewards, errors, _ = pending.result()
            parts = pending.components()
        finally:
            scorer.close()
        assert errors == 0 and rewards.dtype == torch.float32
        torch.testing.assert_close(rewards, expected.float(), rtol=0, atol=1e-6)
        for k, c in enumerate(components):
            assert parts[c.metric].tolist() == pytest.approx([row[k] for row in by_hand])
        assert scorer.pools_made == (1 if workers else 0)


def test_a_reward_that_fails_mid_run_scores_zero_and_counts(userpkg):
    from mcore_rl.rewards import reward_components
    from mcore_rl.rewards.pool import RewardScorer

    components = reward_components(RewardConfig(
        names=["userpkg.rewards:flaky", "userpkg.rewards:stalls", "userpkg.rewards:parity"],
        weights=[1.0, 1.0, 1.0]))
    examples = [Example("q", "1", "1", f"t:{i}") for i in range(3)]
    scorer = RewardScorer(components, num_workers=0, timeout_seconds=0.5)
    pending = scorer.submit(["ok", "boom", ""], examples)
    rewards, errors, _ = pending.result()
    parts = pending.components()
    # flaky raised on "boom"; stalls hung past the timeout on "" (its call was cancelled)
    assert parts["reward/flaky"].tolist() == [1.0, 0.0, 1.0]
    assert parts["reward/stalls"].tolist() == [1.0, 1.0, 0.0]
    assert parts["reward/parity"].tolist() == [0.0, 0.0, 0.0]
    assert rewards.tolist() == [2.0, 1.0, 1.0] and errors == 2


def test_one_plain_reward_of_weight_one_is_the_verifier_itself(userpkg):
    from mcore_rl.rewards import WeightedReward, build_reward
    from mcore_rl.rewards.exact import exact_reward

    assert build_reward(RewardConfig(name="exact")) is exact_reward
    both = build_reward(RewardConfig(names=["exact", "userpkg.rewards:parity"],
                                     weights=[1.0, 0.5]))
    assert isinstance(both, WeightedReward)
    assert both("12", Example("q", "12", "12", "t")) == 1.0 + 0.5 * 0.0
    assert both("123", Example("q", "12", "12", "t")) == 0.0 + 0.5 * 1.0


# ---------------------------------------------------------------------------- plugins

def test_user_plugins_load_by_import_path_and_resolve(userpkg, data_files):
    from mcore_rl.algorithms.registry import advantage_estimator, build_policy_loss
    from mcore_rl.environments import build_environment
    from mcore_rl.rewards import get_reward_fn

    from userpkg import algos, envs, rewards

    cfg = load_config("grpo_synthetic", [
        "reward.name=userpkg.rewards:correct", "env.name=userpkg.envs:AnswerOnce",
        "data.task=userpkg.tasks:arithmetic", "loss.name=userpkg.algos:MyClip",
        "grpo.advantage_estimator=userpkg.algos:centered"])
    assert get_reward_fn(cfg.reward.name) is rewards.correct
    assert isinstance(build_policy_loss(cfg), algos.MyClip)
    assert advantage_estimator(cfg.grpo.advantage_estimator) is algos.centered
    env = build_environment(cfg)
    assert isinstance(env, envs.AnswerOnce) and env.reward is rewards.correct
    train, test = load_task(cfg.data, build_char_tokenizer(), seed=0)
    assert (len(train), len(test)) == (20, 5)
    # an estimator streams when it says per_group = True, as the table's entries do
    streaming = ["grpo.streaming=true", "generation.num_workers=1"]
    load_config("grpo_synthetic", ["grpo.advantage_estimator=userpkg.algos:centered", *streaming])
    with pytest.raises(ConfigError, match="or your estimator with per_group = True"):
        load_config("grpo_synthetic", ["grpo.advantage_estimator=userpkg.algos:whole_batch",
                                       *streaming])
    # a user's environment runs the multi-turn loop, with its load-time rules
    with pytest.raises(ConfigError, match="env.name=userpkg.envs:AnswerOnce .a multi-turn"):
        load_config("grpo_synthetic", ["env.name=userpkg.envs:AnswerOnce", *streaming])


def test_the_guide_examples_need_no_edit_to_the_package(userpkg, tmp_path):
    """The guides' own reward (docs/data-and-rewards.md) and environment
    (docs/environments.md), copied out of them into a user's directory."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    guides = {"my_rewards.py": docs / "data-and-rewards.md", "my_envs.py": docs / "environments.md"}
    commands = []
    for name, guide in guides.items():
        text = guide.read_text()
        block = text.split(f"```python\n# {name}\n", 1)[1].split("```", 1)[0]
        (tmp_path / name).write_text(block)
        commands += [line.split("mcore-rl train ", 1)[1].split() for line in text.splitlines()
                     if line.startswith("mcore-rl train ")
                     and ("my_rewards:" in line or "my_envs:" in line)]
    assert len(commands) == 2
    sys.path.insert(0, str(tmp_path))
    try:
        for overrides in commands:
            load_config("grpo_synthetic", overrides)
        from my_rewards import brevity

        assert brevity("12", Example("q", "12", "12", "t")) == 1.0
    finally:
        sys.path.remove(str(tmp_path))


def test_cfg_says_which_keys_take_an_import_path(capsys):
    assert main(["train", "--cfg"]) == 0
    out = capsys.readouterr().out
    assert '  name: exact  # one of exact, math, model, judge, or a "module:attribute" import path\n' in out
    assert ('  task: synthetic  # one of synthetic, gsm8k, dataset, or a "module:attribute" '
            'import path\n') in out
    for key in ("env", "loss"):
        section = out.split(f"\n{key}:\n", 1)[1]
        assert section.split("\n", 1)[0].endswith('or a "module:attribute" import path')


# ---------------------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """Broken data sets, by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("bad")
    good = {"question": "1+2=", "sum": 3}
    (root / "empty.jsonl").write_text("\n \n")
    (root / "empty.parquet").write_bytes(b"")
    pq.write_table(pa.Table.from_pylist([{"question": "1+2=", "sum": 3}]).slice(0, 0),
                   root / "no_rows.parquet")
    (root / "no_column.jsonl").write_text(json.dumps(good) + "\n"
                                          + json.dumps({"prompt": "2+2=", "sum": 4}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"text": "1+2=", "sum": 3}]), root / "no_column.parquet")
    (root / "empty_prompt.jsonl").write_text(json.dumps(good) + "\n"
                                             + json.dumps({"question": "  ", "sum": 4}) + "\n")
    (root / "no_user.jsonl").write_text(json.dumps(
        {"messages": [{"role": "system", "content": "Add."},
                      {"role": "assistant", "content": "3"}], "sum": 3}) + "\n")
    (root / "not.parquet").write_text(json.dumps(good) + "\n")
    (root / "object.json").write_text(json.dumps({"rows": [good]}))
    (root / "data.csv").write_text("question,sum\n1+2=,3\n")
    (root / "plain_dir").mkdir()
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([good])}).save_to_disk(
        str(root / "no_test_split"))
    (root / "with_difficulty.jsonl").write_text(json.dumps(good) + "\n")
    return root


DATA = ["data.task=dataset", "data.prompt_key=question", "data.answer_key=sum"]
# (id, overrides with {in} for the bad inputs' directory, what the one error line must contain)
BAD = [
    ("missing_column", ["data.train_path={in}/no_column.jsonl"],
     "data.train_path: {in}/no_column.jsonl:2: no column 'question' (data.prompt_key); found "
     "'prompt', 'sum'"),
    ("missing_column_parquet", ["data.train_path={in}/no_column.parquet"],
     "data.train_path: {in}/no_column.parquet: row 0: no column 'question' (data.prompt_key); "
     "found 'text', 'sum'"),
    ("missing_answer_column", ["data.train_path={in}/no_column.jsonl", "data.answer_key=answer"],
     "data.train_path: {in}/no_column.jsonl:1: no column 'answer' (data.answer_key; null for "
     "none); found 'question', 'sum'"),
    ("empty_file", ["data.train_path={in}/empty.jsonl"],
     "data.train_path: {in}/empty.jsonl: empty dataset (no JSON records)"),
    ("empty_parquet_table", ["data.train_path={in}/no_rows.parquet"],
     "data.train_path: {in}/no_rows.parquet: empty dataset (no rows)"),
    ("empty_prompt", ["data.test_path={in}/empty_prompt.jsonl",
                      "data.train_path={in}/with_difficulty.jsonl"],
     "data.test_path: {in}/empty_prompt.jsonl:2: empty prompt (data.prompt_key 'question')"),
    ("messages_without_user", ["data.train_path={in}/no_user.jsonl",
                               "data.messages_key=messages"],
     "data.train_path: {in}/no_user.jsonl:1: data.messages_key 'messages' has no 'user' turn "
     "(roles: system, assistant)"),
    ("not_parquet", ["data.train_path={in}/not.parquet"],
     "data.train_path: {in}/not.parquet: not a Parquet file (pyarrow: "),
    ("empty_parquet_file", ["data.train_path={in}/empty.parquet"],
     "data.train_path: {in}/empty.parquet: not a Parquet file (pyarrow: "),
    ("json_not_an_array", ["data.train_path={in}/object.json"],
     "data.train_path: {in}/object.json: expected a JSON array of objects (or JSON lines), got "
     "a JSON dict"),
    ("unknown_format", ["data.train_path={in}/data.csv"],
     "data.train_path: {in}/data.csv: unknown format '.csv': expected a .jsonl, .json or "
     ".parquet file, or a datasets save_to_disk directory"),
    ("directory_not_saved", ["data.train_path={in}/plain_dir"],
     "data.train_path: {in}/plain_dir: a directory without state.json or dataset_dict.json"),
    ("dataset_dict_without_split", ["data.train_path={in}/with_difficulty.jsonl",
                                    "data.test_path={in}/no_test_split"],
     "data.test_path: {in}/no_test_split: a DatasetDict without a 'test' split (splits: train)"),
    ("no_train_path", [], "data.task=dataset needs data.train_path"),
    ("fraction_and_test_path", ["data.train_path={in}/with_difficulty.jsonl",
                                "data.test_path={in}/with_difficulty.jsonl",
                                "data.test_fraction=0.1"],
     "data.test_fraction=0.1 and data.test_path are both set"),
    ("reward_raises_on_the_first_sample", ["data.train_path={in}/with_difficulty.jsonl",
                                           "reward.name=userpkg.rewards:needs_column"],
     "reward userpkg.rewards:needs_column: needs_column raised on the first training example "
     "({in}/with_difficulty.jsonl:1) given its reference solution: KeyError: 'difficulty'"),
    ("reward_module_not_found", ["data.train_path={in}/with_difficulty.jsonl",
                                 "reward.name=userpkg.nope:score"],
     "reward.name=userpkg.nope:score: module 'userpkg.nope' not found (install it, or put its "
     "directory on PYTHONPATH)"),
    ("reward_module_import_fails", ["data.train_path={in}/with_difficulty.jsonl",
                                    "reward.name=userpkg.broken:score"],
     "reward.name=userpkg.broken:score: importing module 'userpkg.broken' raised "
     "ModuleNotFoundError: No module named 'not_a_package_anywhere'"),
    ("reward_attribute_missing", ["data.train_path={in}/with_difficulty.jsonl",
                                  "reward.names=[exact,userpkg.rewards:corect]"],
     "reward.names[1]=userpkg.rewards:corect: module 'userpkg.rewards' has no attribute "
     "'corect'; did you mean 'correct'?"),
    ("reward_wrong_signature", ["data.train_path={in}/with_difficulty.jsonl",
                                "reward.name=userpkg.rewards:one_argument"],
     "reward.name=userpkg.rewards:one_argument: one_argument(response) cannot be called as "
     "(response_text, example) -> float"),
    ("reward_weights_count", ["data.train_path={in}/with_difficulty.jsonl",
                              "reward.names=[exact,userpkg.rewards:correct]",
                              "reward.weights=[1.0]"],
     "reward.weights has 1 weights for 2 reward(s) (reward.names: exact, "
     "userpkg.rewards:correct): give one weight each"),
    ("environment_without_step", ["data.train_path={in}/with_difficulty.jsonl",
                                  "env.name=userpkg.envs:NoStep"],
     "env.name=userpkg.envs:NoStep: NoStep has no step: an environment is a class with a "
     "classmethod from_config(cfg), reset(example) and step(state, model_turn_text)"),
    ("environment_from_config_not_a_classmethod", ["data.train_path={in}/with_difficulty.jsonl",
                                                   "env.name=userpkg.envs:PlainFromConfig"],
     "env.name=userpkg.envs:PlainFromConfig: PlainFromConfig.from_config must be a classmethod"),
    ("task_wrong_signature", ["data.task=userpkg.rewards:one_argument"],
     "data.task=userpkg.rewards:one_argument: one_argument(response) cannot be called as "
     "(data_config, seed) -> (train, test)"),
    ("task_returns_rows_not_examples", ["data.task=userpkg.tasks:rows"],
     "data.task=userpkg.tasks:rows must return (train, test) lists of "
     "mcore_rl.data.example.Example; got a dict among them"),
    ("loss_that_fails_to_build", ["data.train_path={in}/with_difficulty.jsonl",
                                  "loss.name=userpkg.algos:Broken"],
     "loss.name=userpkg.algos:Broken: Broken(loss config, max_response_length=5) raised "
     "ValueError: needs loss.ratio_clip_low < 0.1"),
    ("loss_without_loss_type", ["data.train_path={in}/with_difficulty.jsonl",
                                "loss.name=userpkg.algos:Untyped"],
     "loss.name=userpkg.algos:Untyped: Untyped.loss_type must be 'token' or 'sequence' (got "
     "None)"),
    ("estimator_wrong_signature", ["data.train_path={in}/with_difficulty.jsonl",
                                   "grpo.advantage_estimator=userpkg.rewards:one_argument"],
     "grpo.advantage_estimator=userpkg.rewards:one_argument: one_argument(response) cannot be "
     "called as (rollout, cfg) -> advantages"),
]


@pytest.mark.parametrize("overrides, expected", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_exits_2_with_one_line(userpkg, bad_inputs, tmp_path, capsys, overrides,
                                         expected):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("the user's own file\n")

    def fill(text: str) -> str:
        return text.replace("{in}", str(bad_inputs))

    with pytest.raises(SystemExit) as info:
        main(["train", "--config-name", "grpo_synthetic", "cluster.use_ray=false",
              f"run.output_dir={run}", *DATA, *map(fill, overrides)])
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line
    assert err.startswith("mcore-rl train: error: ") and fill(expected) in err, err
    assert "Traceback" not in err + out
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # nothing written


# ---------------------------------------------------------------------------- end to end

TINY = [
    "cluster.use_ray=false",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations=4",
    "grpo.max_steps=2",
    "grpo.val_every=2",
    "grpo.val_num_prompts=5",
    "sft.steps=4",
    "sft.batch_size=8",
    "policy.micro_batch_size=8",
    "logging.progress=false",
    "checkpoint.save_final=false",
]


@pytest.mark.slow
@pytest.mark.parametrize("env", ["single_turn", "userpkg.envs:AnswerOnce"])
def test_grpo_runs_on_the_users_data_rewards_environment_loss_and_estimator(
        userpkg, data_files, tmp_path, env):
    from mcore_rl.controller.loops import run
    from mcore_rl.utils.logging import read_metrics

    out = tmp_path / "run"
    run(load_config("grpo_synthetic", TINY + DATA + [
        f"data.train_path={data_files['parquet']}", f"data.test_path={data_files['jsonl']}",
        "reward.names=[userpkg.rewards:correct,userpkg.rewards:level,userpkg.rewards:parity]",
        "reward.weights=[1.0,0.5,0.25]", f"env.name={env}", "env.num_workers=1",
        "loss.name=userpkg.algos:MyClip", "grpo.advantage_estimator=userpkg.algos:centered",
        f"run.output_dir={out}"]))
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["train/reward_errors"] == 0 and r["train/grad_norm"] > 0
        if env == "single_turn":  # each reward logged; their weighted sum is the reward
            parts = [r["reward/correct"], r["reward/level"], r["reward/parity"]]
            assert r["train/reward_mean"] == pytest.approx(
                parts[0] + 0.5 * parts[1] + 0.25 * parts[2], abs=1e-6)
            assert 0 < r["reward/level"] < 2  # the extra column reached the reward
    assert "val/accuracy" in records[-1]
