"""``mcore-rl export``: policy checkpoints saved at TP=2 (padded vocabulary) and at PP=2 (tied
embeddings), after one training step, export to Hugging Face directories from which
transformers loads the saving model: the same weights as that model's live refit export, and
logprobs (log-softmax of the logits, fp32) equal to the Megatron forward's within 1e-4; every
tensor stored once. Missing inputs and a config that does not match the checkpoint are named.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed, use_layout
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from mcore_rl.algorithms.losses import NLLLoss
from mcore_rl.cli import main
from mcore_rl.config.schema import MegatronConfig, ModelArchConfig, OptimizerConfig
from mcore_rl.data.tokenizer import build_char_tokenizer
from mcore_rl.megatron.conversion import arch_to_hf_config

VOCAB = 99  # the character tokenizer's; TP=2 pads the Megatron vocabulary to 100 rows
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=64, max_position_embeddings=64, vocab_size=VOCAB)
RUNS = {
    "tp2": (ModelArchConfig(family="qwen2", qkv_bias=True, tie_word_embeddings=False, **SHAPE),
            dict(tensor_model_parallel_size=2)),
    "pp2": (ModelArchConfig(family="llama", qkv_bias=False, tie_word_embeddings=True, **SHAPE),
            dict(pipeline_model_parallel_size=2)),
}
EOS, PAD = 1, 0  # the character tokenizer's


def _batch(n: int, width: int, seed: int) -> dict:
    """Random tokens, every position after the first a target."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, width)
    mask[:, 0] = 0
    return {"input_ids": torch.randint(0, VOCAB, (n, width), generator=g),
            "input_lengths": torch.full((n,), width), "token_mask": mask,
            "sample_mask": torch.ones(n)}


def _train_and_save(root: str) -> dict:
    """In 2 gloo processes, per run: a PolicyWorker (with a reference policy, so the
    checkpoint holds more than the model) takes one training step and saves its checkpoint;
    returns (rank 0) its logprobs on random tokens and its refit weights."""
    from mcore_rl.workers.policy import PolicyWorker

    out = {}
    for name, (arch, layout) in RUNS.items():
        use_layout(**layout)
        worker = PolicyWorker(
            hf_path=None, hf_config=arch_to_hf_config(arch, VOCAB).to_dict(), vocab_size=VOCAB,
            use_reference=True, arch=arch, megatron=MegatronConfig(**layout),
            optimizer=OptimizerConfig(lr=1e-2), device="cpu", seed=5, total_optimizer_steps=2,
            global_batch_size=4, rank=dist.get_rank(), world_size=dist.get_world_size(),
            master_addr="127.0.0.1", master_port=0)  # the world exists already
        worker.train(_batch(4, 12, seed=1), NLLLoss(), 4, 2)
        worker.save_checkpoint(f"{root}/{name}/checkpoints/step_1/policy")
        out[name] = {"logprobs": worker.get_logprobs(_batch(3, 16, seed=2), 3),
                     "weights": worker.get_hf_weights()}
    return out


def _export_cli(arg_lists) -> subprocess.CompletedProcess:
    """Run ``mcore_rl.cli.main`` on each argument list in one fresh process (the exporter runs
    a torch.distributed world of its own); prints the exit codes as a JSON list."""
    code = ("import json, sys\nfrom mcore_rl.cli import main\ncodes = []\n"
            f"for args in {arg_lists!r}:\n"
            "    try:\n        codes.append(main(args))\n"
            "    except SystemExit as e:\n        codes.append(e.code)\n"
            "print(json.dumps(codes))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    saved = run_distributed(_train_and_save, 2, str(root))[0]
    for name, (arch, _) in RUNS.items():  # what the trainer writes into a run directory
        config = arch_to_hf_config(arch, VOCAB)
        config.eos_token_id, config.pad_token_id = EOS, PAD
        config.to_json_file(root / name / "hf_config.json", use_diff=False)
        build_char_tokenizer().save_pretrained(root / name / "tokenizer")
    wrong = arch_to_hf_config(RUNS["tp2"][0], VOCAB - 2)  # rows 97, 98 hold trained tokens
    wrong.to_json_file(root / "wrong_vocab.json", use_diff=False)
    args = [["export", "--checkpoint", str(root / name / "checkpoints" / "step_1"),
             "--output", str(root / f"{name}_hf"), "--max-shard-size", "20KB"] for name in RUNS]
    args.append(["export", "--checkpoint", str(root / "tp2" / "checkpoints" / "step_1"),
                 "--output", str(root / "wrong_hf"), "--hf-config", str(root / "wrong_vocab.json")])
    proc = _export_cli(args)
    assert proc.returncode == 0, proc.stderr
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    return root, saved, codes, proc.stderr


@pytest.mark.parametrize("name", list(RUNS))
def test_transformers_loads_the_saved_model(exported, name):
    root, saved, codes, stderr = exported
    assert codes[:2] == [0, 0], stderr
    model, info = AutoModelForCausalLM.from_pretrained(root / f"{name}_hf", dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # The weights equal those the saving model gathers live across its TP/PP ranks.
    weights = saved[name]["weights"]
    state = model.state_dict()
    tied = RUNS[name][0].tie_word_embeddings
    assert set(state) - set(weights) == ({"lm_head.weight"} if tied else set())
    for key, tensor in weights.items():
        assert torch.equal(state[key], tensor), key
    if tied:
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    # Logprobs of random tokens: HF logits through log-softmax vs the Megatron forward.
    batch = _batch(3, 16, seed=2)
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    assert (lp - saved[name]["logprobs"][:, 1:]).abs().max() < 1e-4


@pytest.mark.parametrize("name", list(RUNS))
def test_every_tensor_stored_once(exported, name):
    root, *_ = exported
    out = root / f"{name}_hf"

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)

    index = json.loads((out / "model.safetensors.index.json").read_text(),
                       object_pairs_hook=no_duplicates)
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1  # --max-shard-size 20KB splits this model
    stored = {}
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            for key in f.keys():
                assert key not in stored, f"{key} in {shard} and {stored.get(key)}"
                stored[key] = shard
    assert stored == weight_map
    config = json.loads((out / "config.json").read_text())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(arch_to_hf_config(RUNS[name][0], VOCAB))
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert set(weight_map) == expected
    assert config["dtype"] == "float32" and config["eos_token_id"] == EOS


def test_tokenizer_and_generation_config_come_along(exported):
    root, *_ = exported
    out = root / "tp2_hf"
    text = "12+30=42"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == build_char_tokenizer()(text).input_ids
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (EOS, PAD)


def test_config_that_does_not_match_is_refused(exported):
    root, _, codes, stderr = exported
    assert codes[2] == 2
    assert str(root / "tp2" / "checkpoints" / "step_1" / "policy") in stderr
    assert str(root / "wrong_vocab.json") in stderr and "vocab_size 97" in stderr
    assert not (root / "wrong_hf" / "model.safetensors").exists()


def _cli_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main(["export", *args])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_missing_inputs_are_named(tmp_path, capsys):
    out = str(tmp_path / "hf")
    missing = tmp_path / "runs" / "r" / "checkpoints" / "step_3"
    assert str(missing) in _cli_error(capsys, "--checkpoint", str(missing), "--output", out)
    missing.mkdir(parents=True)  # a directory without the checkpoint files
    assert str(missing / "policy") in _cli_error(capsys, "--checkpoint", str(missing), "--output", out)
    (missing / "policy").mkdir()
    (missing / "policy" / "metadata.json").write_text("{}")
    run_dir = tmp_path / "runs" / "r"
    assert str(run_dir / "hf_config.json") in _cli_error(capsys, "--checkpoint", str(missing),
                                                         "--output", out)
    arch_to_hf_config(ModelArchConfig(vocab_size=VOCAB), VOCAB).to_json_file(run_dir / "hf_config.json")
    assert str(run_dir / "tokenizer") in _cli_error(capsys, "--checkpoint", str(missing), "--output", out)
    (run_dir / "tokenizer").mkdir()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.safetensors").write_text("")
    assert out in _cli_error(capsys, "--checkpoint", str(missing), "--output", out)
    assert "--max-shard-size" in _cli_error(capsys, "--checkpoint", str(missing), "--output",
                                            str(tmp_path / "new"), "--max-shard-size", "5XB")


def test_load_on_cpu_reads_a_gpu_saved_common_state_on_a_cpu_machine(monkeypatch):
    """A checkpoint's common state saved by GPU workers holds storages tagged cuda:0; a bare
    ``torch.load`` (as torch.distributed.checkpoint reads it) fails on a machine without
    CUDA, and export's ``load_on_cpu`` reads it onto the CPU."""
    import io

    from mcore_rl.export import load_on_cpu

    buf = io.BytesIO()
    with monkeypatch.context() as m:  # tag the storages as a GPU rank's save does
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"step": torch.tensor([3.0, 4.0])}, buf)
    buf.seek(0)
    with pytest.raises(RuntimeError):
        torch.load(buf, weights_only=False)
    buf.seek(0)
    with load_on_cpu():
        state = torch.load(buf, weights_only=False)
    assert state["step"].device.type == "cpu" and state["step"].tolist() == [3.0, 4.0]
    assert torch.load is not None and "load_on_cpu" not in repr(torch.load)
