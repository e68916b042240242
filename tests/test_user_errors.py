"""Mistakes in the user's input, through the ``mcore-rl`` command: each exits with status 2 and
one line naming what is wrong and where (config key, file, line), with no traceback, before any
worker starts, and leaves an existing run directory as it was. ``--debug`` or
``MCORE_RL_DEBUG=1`` shows the traceback; other errors keep theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mcore_rl.cli import main
from mcore_rl.config import ConfigError
from mcore_rl.data.tokenizer import build_char_tokenizer

GOOD = json.dumps({"question": "What is 1+1?", "answer": "1+1=2\n#### 2"})
# The gsm8k config on CPU without Ray; plain prompts (the character tokenizer has no chat template).
BASE = ["--config-name", "grpo_gsm8k", "cluster.use_ray=false", "cluster.device=cpu",
        "data.use_chat_template=false"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Broken data files and model directories, by name."""
    root = tmp_path_factory.mktemp("inputs")

    def write(name: str, lines: list[str]) -> None:
        (root / name).write_text("".join(line + "\n" for line in lines))

    write("empty.jsonl", ["", " "])
    write("bad_json.jsonl", [GOOD, '{"question": "q", "answer": "#### 1"'])
    write("no_hashes.jsonl", [GOOD, "", json.dumps({"question": "q", "answer": "just 4"})])
    write("wrong_fields.jsonl", [json.dumps({"problem": "q", "solution": "#### 4"})])
    (root / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    (root / "empty_model").mkdir()
    for name, files in {"no_weights": ["config.json", "tokenizer.json"],
                        "no_tokenizer": ["config.json", "model.safetensors"],
                        "missing_shard": ["config.json", "tokenizer.json",
                                          "model-00001-of-00002.safetensors"]}.items():
        (root / name).mkdir()
        for file in files:
            (root / name / file).write_text("{}")
    (root / "missing_shard" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors"}}))
    # Loads (config and tokenizer) but is no Llama/Qwen2: refused before any worker.
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(root / "gpt2")
    build_char_tokenizer().save_pretrained(root / "gpt2")
    (root / "gpt2" / "model.safetensors").write_text("{}")
    # SmolLM2-135M's head counts (9 heads, 3 KV groups) in a tiny Llama; the character tokenizer
    # has no chat template.
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, hidden_size=72, intermediate_size=64, num_attention_heads=9,
                num_key_value_heads=3, vocab_size=99).save_pretrained(root / "nine_heads")
    build_char_tokenizer().save_pretrained(root / "nine_heads")
    (root / "nine_heads" / "model.safetensors").write_text("{}")
    (root / "not_a.gguf").write_text("this is a text file, not a GGUF model\n")
    (root / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    return root


# (id, overrides with {in} for the inputs directory, what the one error line must contain;
# {run} is the run directory).
CASES = [
    ("empty_file", ["data.train_path={in}/empty.jsonl"],
     "data.train_path: {in}/empty.jsonl: empty dataset (no JSON records)"),
    ("missing_file", ["data.train_path={in}/nope.jsonl"],
     "data.train_path: {in}/nope.jsonl: no such file"),
    ("bad_json_line", ["data.train_path={in}/bad_json.jsonl"],
     "data.train_path: {in}/bad_json.jsonl:2: malformed JSON"),
    ("missing_####", ["data.train_path={in}/no_hashes.jsonl"],
     "data.train_path: {in}/no_hashes.jsonl:3: answer has no final '#### N' line"),
    ("wrong_field_names", ["data.test_path={in}/wrong_fields.jsonl"],
     "data.test_path: {in}/wrong_fields.jsonl:1: missing or non-string field 'question' (a GSM8K "
     "record has string fields 'question' and 'answer'; found 'problem', 'solution')"),
    ("not_utf8", ["data.train_path={in}/latin1.jsonl"],
     "data.train_path: {in}/latin1.jsonl:1: not UTF-8 text"),
    ("prompt_too_long", ["data.max_prompt_length=8", "data.max_total_length=136"],
     "samples/gsm8k/train.jsonl:1: prompt is 155 tokens; it must be 1 to "
     "data.max_prompt_length=8 tokens"),
    ("nonexistent_model_dir", ["model.hf_path={in}/no_model"],
     "model.hf_path: {in}/no_model: no such directory"),
    ("empty_model_dir", ["model.hf_path={in}/empty_model"],
     "model.hf_path: {in}/empty_model: no config.json (not a Hugging Face checkpoint directory)"),
    ("model_dir_without_weights", ["model.hf_path={in}/no_weights"],
     "model.hf_path: {in}/no_weights: no weights (model.safetensors or "
     "model.safetensors.index.json)"),
    ("model_dir_missing_shard", ["model.hf_path={in}/missing_shard"],
     "model.hf_path: {in}/missing_shard: model.safetensors.index.json lists missing shards "
     "model-00002-of-00002.safetensors"),
    ("tokenizer_missing", ["model.hf_path={in}/no_tokenizer"],
     "model.hf_path: {in}/no_tokenizer: no tokenizer files (tokenizer.json, "
     "tokenizer_config.json, tokenizer.model, vocab.json); add them or set model.tokenizer"),
    ("tokenizer_dir_missing", ["model.tokenizer={in}/no_tok"],
     "model.tokenizer: {in}/no_tok: no such directory"),
    ("unsupported_model", ["model.hf_path={in}/gpt2", "data.max_prompt_length=1024",
                           "data.max_total_length=1152"],
     "model.hf_path: {in}/gpt2: config model_type='gpt2' is not supported"),
    ("heads_not_divisible_by_tp", ["model.hf_path={in}/nine_heads", "cluster.num_workers=2",
                                   "policy.megatron.tensor_model_parallel_size=2"],
     "num_attention_heads (9) of model.hf_path={in}/nine_heads must be divisible by "
     "policy.megatron.tensor_model_parallel_size (2)"),
    ("no_chat_template", ["model.hf_path={in}/nine_heads", "data.use_chat_template=true"],
     "data.use_chat_template=true but the tokenizer of model.hf_path={in}/nine_heads has no chat "
     "template"),
    ("unknown_reward_name", ["reward.name=f1"],
     "reward.name must be one of exact, math, model, judge, or a \"module:attribute\" "
     "import path (got 'f1')"),
    ("bad_override_key", ["grpo.num_generation=4"],
     "unknown config key 'grpo.num_generation' (from override 'grpo.num_generation=4'); did you "
     "mean 'grpo.num_generations'?"),
    ("bad_override_value", ["loss.kl_coef=-1"], "loss.kl_coef must be >= 0 (got -1.0)"),
    ("train_forward_with_several_optimizer_steps",
     ["loss.prev_logprobs=train_forward", "grpo.optimizer_steps_per_rollout=2"],
     "loss.prev_logprobs=train_forward needs algorithm=grpo, grpo.optimizer_steps_per_rollout=1 "
     "and grpo.reward_kl_coef=0 (the old policy must be the weights being trained, and no "
     "estimator may read its logprobs before the training forward); got "
     "grpo.optimizer_steps_per_rollout=2: set loss.prev_logprobs=recompute"),
    ("bad_override_type", ["grpo.max_steps=many"],
     "wrong type for config key 'grpo.max_steps' (from override 'grpo.max_steps=many'): "
     "expected int, got 'many'"),
    ("run_directory_already_used", [],
     "run.output_dir={run} already holds a run (metrics.jsonl); continue it with "
     "checkpoint.resume=latest"),
]


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("overrides, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_user_error_exits_2_with_one_line_and_leaves_the_run_directory_alone(
        inputs, tmp_path, capsys, overrides, expected):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("the user's own file\n")
    if "run.output_dir" in expected:
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _snapshot(run)

    def fill(text: str) -> str:
        return text.replace("{in}", str(inputs)).replace("{run}", str(run))

    with pytest.raises(SystemExit) as info:
        main(["train", *BASE, f"run.output_dir={run}", *map(fill, overrides)])
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line
    assert err.startswith("mcore-rl train: error: ") and fill(expected) in err, err
    assert "Traceback" not in err + out
    assert _snapshot(run) == before  # nothing written, nothing removed


def test_debug_flag_and_environment_show_the_traceback(monkeypatch, tmp_path, capsys):
    argv = ["train", *BASE, f"run.output_dir={tmp_path}", "reward.name=f1"]
    with pytest.raises(ConfigError, match="reward.name must be one of"):
        main([*argv, "--debug"])
    monkeypatch.setenv("MCORE_RL_DEBUG", "1")
    with pytest.raises(ConfigError, match="reward.name must be one of"):
        main(argv)
    monkeypatch.setenv("MCORE_RL_DEBUG", "0")
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "reward.name" in capsys.readouterr().err


@pytest.mark.parametrize("error", [ValueError("a bug, not the user's input"), KeyError("x")])
def test_other_errors_keep_their_traceback(monkeypatch, error):
    fake = types.ModuleType("mcore_rl.controller.loops")

    def run(cfg):
        raise error

    fake.run = run
    monkeypatch.setitem(sys.modules, "mcore_rl.controller.loops", fake)
    with pytest.raises(type(error)):
        main(["train", "--config-name", "grpo_synthetic"])


def test_the_command_in_its_own_process_prints_only_the_line(inputs, tmp_path):
    """The original report: an empty data file gave an 11-frame traceback and exit status 1."""
    argv = [sys.executable, "-m", "mcore_rl", "train", *BASE, f"run.output_dir={tmp_path / 'run'}",
            f"data.train_path={inputs}/empty.jsonl"]
    env = {k: v for k, v in os.environ.items() if k != "MCORE_RL_DEBUG"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"mcore-rl train: error: data.train_path: {inputs}/empty.jsonl: "
                           "empty dataset (no JSON records)\n"), done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, expected", [
    ("not_a.gguf", "--gguf {in}/not_a.gguf: not a GGUF file (starts with b'this'"),
    ("truncated.gguf", "--gguf {in}/truncated.gguf: transformers cannot read it"),
    ("missing.gguf", "--gguf {in}/missing.gguf: no such file"),
])
def test_convert_gguf_refuses_what_is_not_a_gguf(inputs, tmp_path, capsys, name, expected):
    output = tmp_path / "models" / "out"
    with pytest.raises(SystemExit) as info:
        main(["convert-gguf", "--gguf", str(inputs / name), "--output", str(output),
              "--no-install"])
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("mcore-rl convert-gguf: error: "), err
    assert expected.replace("{in}", str(inputs)) in err, err
    assert not output.exists() and not (output.parent.exists() and any(output.parent.iterdir()))
