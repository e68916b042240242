"""Learned rewards without a model run: the judge's score parsing and its errors, the learned
reward's place in the RL step (submit / result / metrics, the tracked verifier), the tokenizer
comparison, the checkpoint's tensor names, the preference file reader, and every bad input of
issue 36 through the ``mcore-rl`` command: exit status 2, one line naming what and where,
nothing trained (no run directory written)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from mcore_rl.cli import main
from mcore_rl.config import ConfigError
from mcore_rl.controller.learned_rewards import LearnedRewards, Scored, parse_score
from mcore_rl.data.example import Example
from mcore_rl.data.preferences import load_preference_pairs
from mcore_rl.data.tokenizer import build_char_tokenizer, tokenizer_difference

CPU = ["cluster.use_ray=false", "cluster.device=cpu", "logging.progress=false",
       "logging.tensorboard=false"]


def test_parse_score_reads_the_first_number_in_range():
    number = re.compile(r"-?\d+(?:\.\d+)?")
    assert parse_score("I rate it 7 out of 10", number, 0, 10) == pytest.approx(0.7)
    assert parse_score("10", number, 0, 10) == 1.0
    assert parse_score("score: 2.5, not 9", number, 0, 10) == pytest.approx(0.25)
    assert parse_score("no digits here", number, 0, 10) is None
    assert parse_score("11", number, 0, 10) is None  # out of range is an error, not 1
    assert parse_score("-1", number, 0, 10) is None
    grouped = re.compile(r"Rating: (\d+)")
    assert parse_score("3 things. Rating: 4", grouped, 0, 4) == 1.0


class _Judge:
    """A learned reward that rates the responses' lengths and records its calls."""

    def __init__(self):
        self.calls = 0

    def score(self, rollout, texts, examples):
        self.calls += 1
        rewards = torch.tensor([float(len(t)) for t in texts])
        return Scored(rewards, sum(not t for t in texts), {"judge_errors": float(sum(not t for t in texts))})

    def close(self):
        pass


class _Verifier:
    """The verifier pool's interface: 1 when the response is the example's answer."""

    def _rewards(self, texts, examples):
        return torch.tensor([float(t == ex.answer) for t, ex in zip(texts, examples)])

    def submit(self, texts, examples):
        from mcore_rl.rollout.producer import ScoredNow

        return ScoredNow(self._rewards(texts, examples), 0, 0.25)

    def score(self, texts, examples):
        return self._rewards(texts, examples), 0, 0.25


def test_learned_rewards_replace_the_verifier_which_is_logged_beside():
    examples = [Example("1+1=", "2", "2", "s:0"), Example("2+2=", "4", "4", "s:1")]
    texts = ["2", ""]
    learned = LearnedRewards(_Judge(), _Verifier())
    try:
        rewards, errors, busy = learned.submit({}, texts, examples).result()
        assert rewards.tolist() == [1.0, 0.0] and errors == 1 and busy == 0.25
        train = learned.pop_metrics("train/")
        assert train["train/verifier_reward"] == 0.5 and train["train/judge_errors"] == 1.0
        assert train["timing/learned_reward_s"] >= 0
        rewards, errors, _ = learned.score({}, ["22", "4"], examples, "val/")
        assert rewards.tolist() == [2.0, 1.0] and errors == 0
        assert learned.pop_metrics("train/") == {}
        assert learned.pop_metrics("val/") == {"val/judge_errors": 0.0, "val/verifier_reward": 0.5}
    finally:
        learned.close()
    alone = LearnedRewards(_Judge())  # no reward.verifier: nothing tracked
    assert alone.submit({}, ["x"], examples[:1]).result()[0].tolist() == [1.0]
    assert "train/verifier_reward" not in alone.pop_metrics("train/")
    alone.close()


def test_judge_scores_parsed_answers_and_counts_what_does_not_parse():
    from mcore_rl.config.loader import load_config
    from mcore_rl.controller.learned_rewards import JudgeReward
    from mcore_rl.data.prompts import response_rows

    cfg = load_config("grpo_synthetic", ["reward.name=judge", "judge.max_prompt_length=120"])
    tok = build_char_tokenizer()
    judge = JudgeReward(cfg, tok)
    answers = iter(["8", "nothing", "12", "0.5"])
    seen = []

    class Backend:
        def generate(self, prompts, seed, greedy):
            seen.append((prompts, greedy))
            rows = [(p, tok(next(answers))["input_ids"] + [tok.eos_token_id]) for p in prompts]
            batch = response_rows(rows)
            batch["response_lengths"] = batch["input_lengths"] - batch["prompt_lengths"]
            return batch

    judge.backend = Backend()
    examples = [Example(f"{i}+1=", str(i + 1), "", f"s:{i}") for i in range(5)]
    texts = ["1", "2", "3", "4" * 80, "5"]  # the fourth prompt is over judge.max_prompt_length
    scored = judge.score({}, texts, examples)
    assert scored.rewards.tolist() == pytest.approx([0.8, 0.0, 0.0, 0.0, 0.05])
    assert scored.errors == 3 and scored.metrics["judge_errors"] == 3.0
    prompts, greedy = seen[0]
    assert greedy and len(prompts) == 4
    first = tok.decode(prompts[0])
    assert first.startswith("Rate the response") and "Question: 0+1=" in first and "Response: 1" in first


def _reordered_char_tokenizer():
    """The character tokenizer with the ids of "a" and "b" swapped (same tokens, other ids)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(build_char_tokenizer().backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_tokenizer_difference_names_what_differs():
    a = build_char_tokenizer()
    assert tokenizer_difference(a, build_char_tokenizer()) is None
    assert "vocabularies differ" in tokenizer_difference(a, _reordered_char_tokenizer())


def test_checkpoint_tensor_names_read_the_safetensors_header(tmp_path):
    from safetensors.torch import save_file

    from mcore_rl.config.learned import checkpoint_tensor_names

    save_file({"model.norm.weight": torch.ones(2), "score.weight": torch.ones(1, 2)},
              tmp_path / "model.safetensors")
    assert checkpoint_tensor_names(str(tmp_path)) == {"model.norm.weight", "score.weight"}
    (tmp_path / "model.safetensors").write_text("not safetensors")
    assert checkpoint_tensor_names(str(tmp_path)) is None


def test_preference_file_errors_name_the_line(tmp_path):
    good = json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"})
    cases = {
        "missing.jsonl": ([good, json.dumps({"prompt": "p", "chosen": "2"})],
                          ":2: missing field 'rejected'"),
        "nonstring.jsonl": ([json.dumps({"chosen": ["2"], "rejected": "3"})],
                            ":1: non-string field 'chosen'"),
        "malformed.jsonl": ([good, "", '{"chosen": "2", "rejected"'], ":3: malformed JSON"),
        "margin.jsonl": ([json.dumps({"chosen": "2", "rejected": "3", "margin": -1})],
                         ":1: field 'margin' must be a number >= 0"),
        "empty.jsonl": (["", " "], ": no preference pairs"),
    }
    for name, (lines, message) in cases.items():
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(ConfigError, match=re.escape(f"rm.train_path: {path}{message}")):
            load_preference_pairs(path, "rm.train_path")
    (tmp_path / "ok.jsonl").write_text(good + "\n" + json.dumps(
        {"chosen": "a", "rejected": "b", "margin": 2}) + "\n")
    pairs = load_preference_pairs(tmp_path / "ok.jsonl")
    assert [(p.prompt, p.margin) for p in pairs] == [("1+1=", 0.0), ("", 2.0)]


def test_prefixed_placement_names_the_judges_groups_apart():
    from mcore_rl.controller.learned_rewards import PrefixedPlacement

    class Placement:
        use_ray, gpus, dump_dir = False, True, "/hang"

        def __init__(self):
            self.plan = self

        def gpu_index(self, group, rank):
            return {"judge_vllm": 3}[group] + rank

        def actor_options(self, group, rank):
            return {"group": group, "rank": rank}

        def make_group(self, group, worker_cls, kwargs, env=None):
            return group, worker_cls, kwargs, env

    view = PrefixedPlacement(Placement(), "judge_")
    assert (view.use_ray, view.gpus, view.dump_dir) == (False, True, "/hang")
    assert view.plan.gpu_index("vllm", 1) == 4
    assert view.actor_options("vllm", 0) == {"group": "judge_vllm", "rank": 0}
    assert view.make_group("generation", int, {}) == ("judge_generation", int, {}, None)
    assert view.make_group("policy", int, {}, env={"A": "1"}) == ("judge_policy", int, {},
                                                                  {"A": "1"})


def test_retokenized_rows_are_the_reward_models_tokens(inputs):
    """reward_model.retokenize=true: the prompt (data.prompt_template) and the response decoded
    and tokenized again with the reward model's tokenizer, eos after a finished response."""
    from mcore_rl.config.loader import load_config
    from mcore_rl.controller.learned_rewards import RewardModelReward

    cfg = load_config("grpo_synthetic", ["reward.name=model", "reward_model.retokenize=true",
                                         f"reward_model.hf_path={inputs / 'rm_other_tok'}"])
    reward = RewardModelReward(cfg, build_char_tokenizer())
    assert reward.retokenize
    examples = [Example("ab+1=", "", "", "s:0"), Example("b+a=", "", "", "s:1")]
    rows = reward._rows({"truncated": torch.tensor([0.0, 1.0])}, ["ba", "abab"], examples)
    other = _reordered_char_tokenizer()
    expected = [other("ab+1=ba")["input_ids"] + [other.eos_token_id], other("b+a=abab")["input_ids"]]
    assert rows["input_lengths"].tolist() == [len(e) for e in expected]
    for row, ids in zip(rows["input_ids"], expected):
        assert row[:len(ids)].tolist() == ids
    assert expected[0] != build_char_tokenizer()("ab+1=ba")["input_ids"] + [1]  # other ids


# ---------------------------------------------------------------------------- bad inputs (CLI)
@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Preference files, a causal LM without a score head, a reward model whose tokenizer is
    not the policy's (the character tokenizer's vocabulary, reordered)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from mcore_rl.config.schema import ModelArchConfig
    from mcore_rl.megatron.conversion import arch_to_hf_config

    root = tmp_path_factory.mktemp("learned_inputs")
    good = json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"})
    (root / "good.jsonl").write_text(good + "\n")
    (root / "no_rejected.jsonl").write_text(good + "\n" + json.dumps({"chosen": "2"}) + "\n")
    (root / "malformed.jsonl").write_text(good + "\n" + '{"chosen": "2",' + "\n")
    arch = ModelArchConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                           ffn_hidden_size=32, max_position_embeddings=32, vocab_size=99)
    config = arch_to_hf_config(arch, 99)
    config.pad_token_id = 0
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "lm")
    build_char_tokenizer().save_pretrained(root / "lm")
    config.num_labels = 1
    AutoModelForSequenceClassification.from_config(config).save_pretrained(root / "rm_other_tok")
    _reordered_char_tokenizer().save_pretrained(root / "rm_other_tok")
    return root


BAD = [
    ("preference line without rejected",
     ["algorithm=rm", "rm.train_path={in}/no_rejected.jsonl"],
     "rm.train_path: {in}/no_rejected.jsonl:2: missing field 'rejected'"),
    ("malformed preference line", ["algorithm=rm", "rm.train_path={in}/good.jsonl",
                                   "rm.test_path={in}/malformed.jsonl"],
     "rm.test_path: {in}/malformed.jsonl:2: malformed JSON"),
    ("reward model without a score head", ["reward.name=model", "reward_model.hf_path={in}/lm"],
     "reward_model.hf_path: {in}/lm: no score head (score.weight"),
    ("reward model with another tokenizer", ["reward.name=model",
                                             "reward_model.hf_path={in}/rm_other_tok"],
     "the reward model's tokenizer ({in}/rm_other_tok) differs from the policy's: vocabularies "
     "differ"),
    ("judge template without the response", ["reward.name=judge",
                                             "judge.template='Rate {{prompt}} from 0 to 10:'"],
     "has no {{response}} placeholder"),
    ("two learned rewards", ["reward.names=[exact,model,judge]", "reward.weights=[1,1,1]",
                             "reward_model.hf_path={in}/rm_other_tok"],
     "reward.names=[exact,model,judge] names 2 learned rewards (model, judge): a run scores with "
     "at most one"),
    ("weights beside a learned component", ["reward.names=[exact,model]", "reward.weights=[1.0]",
                                            "reward_model.hf_path={in}/rm_other_tok"],
     "reward.weights has 1 weights for 2 reward(s) (reward.names: exact, model)"),
    ("learned component without its checkpoint", ["reward.names=[exact,model]"],
     "a reward model (model in reward.name or reward.names) needs reward_model.hf_path"),
    ("tracked verifier without a learned reward", ["reward.names=[exact,math]",
                                                   "reward.verifier=exact"],
     "reward.verifier=exact tracks a verifier beside a learned reward (model or judge in "
     "reward.name or reward.names); reward.names=[exact,math] has none"),
]


@pytest.mark.parametrize("overrides, message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_exits_2_with_one_line_and_trains_nothing(inputs, tmp_path, capsys, overrides,
                                                            message):
    run = tmp_path / "run"
    args = ["train", "--config-name", "grpo_synthetic", *CPU, f"run.output_dir={run}",
            *[o.format(**{"in": inputs}) for o in overrides]]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert message.format(**{"in": inputs}) in err
    assert not run.exists()  # nothing trained, nothing written
