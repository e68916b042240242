"""Prompt data: synthetic task, GSM8K loader, tokenizers, prompt datasets and the sampler."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mcore_rl.config import ConfigError
from mcore_rl.config.schema import DataConfig, ModelConfig, SyntheticTaskConfig
from mcore_rl.data.example import Example
from mcore_rl.data.gsm8k import GSM8K_SAMPLE_DIR, load_gsm8k
from mcore_rl.data.prompts import PromptDataset, PromptSampler, load_task, sft_batch
from mcore_rl.data.synthetic import make_synthetic_examples
from mcore_rl.data.tokenizer import CHARSET, build_char_tokenizer, load_tokenizer

REAL_GSM8K = Path("/work/shared/data/gsm8k")


# ---------------------------------------------------------------------------- synthetic task

def test_synthetic_deterministic_disjoint_and_correct():
    cfg = SyntheticTaskConfig(operations="+-*", min_value=-5, max_value=20, num_train=300,
                              num_test=50)
    train, test = make_synthetic_examples(cfg, seed=3)
    assert (len(train), len(test)) == (300, 50)
    assert make_synthetic_examples(cfg, seed=3) == (train, test)
    assert make_synthetic_examples(cfg, seed=4)[0] != train
    train_prompts = {ex.prompt for ex in train}
    test_prompts = {ex.prompt for ex in test}
    assert len(train_prompts) == 300 and len(test_prompts) == 50
    assert not train_prompts & test_prompts
    seen_ops = set()
    for ex in train + test:
        m = re.fullmatch(r"(-?\d+)([+*-])(-?\d+)=", ex.prompt)
        assert m, ex.prompt
        a, op, b = int(m[1]), m[2], int(m[3])
        assert -5 <= a <= 20 and -5 <= b <= 20
        seen_ops.add(op)
        # Python's own arithmetic as the reference.
        assert ex.answer == ex.solution == str(eval(ex.prompt[:-1]))
    assert seen_ops == {"+", "-", "*"}
    assert train[17].source == "synthetic:train:17" and test[0].source == "synthetic:test:0"


def test_synthetic_exhausts_small_space_and_refuses_too_many():
    cfg = SyntheticTaskConfig(operations="+", min_value=0, max_value=2, num_train=6, num_test=3)
    train, test = make_synthetic_examples(cfg, seed=0)
    assert {ex.prompt for ex in train + test} == {f"{a}+{b}=" for a in range(3) for b in range(3)}
    with pytest.raises(ValueError,
                       match=r"data\.synthetic\.num_train.*data\.synthetic\.num_test.*10.*9"):
        make_synthetic_examples(replace(cfg, num_train=7), seed=0)


@pytest.mark.parametrize("field,value,key", [
    ("operations", "+/", "data.synthetic.operations"),
    ("operations", "++", "data.synthetic.operations"),
    ("operations", "", "data.synthetic.operations"),
    ("min_value", 200, "data.synthetic.min_value"),
    ("num_train", 0, "data.synthetic.num_train"),
])
def test_synthetic_bad_config(field, value, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        make_synthetic_examples(replace(SyntheticTaskConfig(), **{field: value}), seed=0)


# ---------------------------------------------------------------------------- GSM8K loader

def test_gsm8k_sample():
    train = load_gsm8k(GSM8K_SAMPLE_DIR / "train.jsonl")
    test = load_gsm8k(GSM8K_SAMPLE_DIR / "test.jsonl")
    assert (len(train), len(test)) == (64, 32)
    first = train[0]
    assert first.prompt.startswith("Natalia sold clips to 48 of her friends")
    assert first.answer == "72"
    assert first.solution == ("Natalia sold 48/2 = 24 clips in May.\n"
                              "Natalia sold 48+24 = 72 clips altogether in April and May.\n"
                              "The answer is 72.")
    assert first.source == f"{GSM8K_SAMPLE_DIR / 'train.jsonl'}:1"
    for ex in train + test:
        assert re.fullmatch(r"-?\d+", ex.answer)
        assert ex.solution.endswith(f"The answer is {ex.answer}.")
        assert "<<" not in ex.solution and "####" not in ex.solution
    assert (GSM8K_SAMPLE_DIR / "LICENSE").read_text().startswith("MIT License")


@pytest.mark.skipif(not REAL_GSM8K.is_dir(), reason="real GSM8K files not present")
def test_gsm8k_real_files_and_sample_is_their_head():
    train = load_gsm8k(REAL_GSM8K / "train.jsonl")
    test = load_gsm8k(REAL_GSM8K / "test.jsonl")
    assert (len(train), len(test)) == (7473, 1319)
    assert all(re.fullmatch(r"-?\d+", ex.answer) for ex in train + test)
    # Thousands separators are dropped from the answer: the raw file says "#### 1,080".
    raw = [json.loads(line) for line in (REAL_GSM8K / "train.jsonl").read_text().splitlines()]
    with_comma = [i for i, r in enumerate(raw) if "," in r["answer"].rpartition("####")[2]]
    assert with_comma
    for i in with_comma:
        assert train[i].answer == raw[i]["answer"].rpartition("####")[2].strip().replace(",", "")
    sample = load_gsm8k(GSM8K_SAMPLE_DIR / "train.jsonl")
    assert [(e.prompt, e.answer, e.solution) for e in sample] == \
        [(e.prompt, e.answer, e.solution) for e in train[:64]]


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"question": "What is 1+1?", "answer": "1+1=2\n#### 2"})


@pytest.mark.parametrize("bad_line,message", [
    ('{"question": "q", "answer": "#### 1"', "malformed JSON"),
    ('["question", "answer"]', "expected a JSON object"),
    (json.dumps({"question": "q"}), "'answer'"),
    (json.dumps({"q": "q", "a": "#### 1"}), "missing or non-string field 'question' (a GSM8K "
     "record has string fields 'question' and 'answer'; found 'q', 'a')"),
    (json.dumps({"question": "q", "answer": "no final line"}), "#### N"),
    (json.dumps({"question": "q", "answer": "2\n#### "}), "#### N"),
])
def test_gsm8k_bad_line_names_key_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path, [GOOD, "", bad_line])
    with pytest.raises(ConfigError, match=re.escape(f"data.train_path: {path}:3: ") + ".*"
                       + re.escape(message)):
        load_gsm8k(path, key="data.train_path")
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}:3: ")):  # no key given
        load_gsm8k(path)


def test_gsm8k_empty_missing_and_not_utf8_file(tmp_path):
    empty = _write(tmp_path, ["", "  "])
    with pytest.raises(ConfigError, match=re.escape(f"data.train_path: {empty}: empty dataset")):
        load_gsm8k(empty, key="data.train_path")
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=re.escape(f"data.test_path: {missing}: no such file")):
        load_gsm8k(missing, key="data.test_path")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes((GOOD + "\n").encode() + '{"question": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(f"{latin1}:2: not UTF-8 text")):
        load_gsm8k(latin1)


def test_gsm8k_with_a_byte_order_mark_equals_the_file_without(tmp_path):
    plain = GSM8K_SAMPLE_DIR / "test.jsonl"
    with_bom = tmp_path / "bom.jsonl"
    with_bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    expected = load_gsm8k(plain)
    got = load_gsm8k(with_bom)
    assert [(e.prompt, e.answer, e.solution) for e in got] == \
        [(e.prompt, e.answer, e.solution) for e in expected]
    assert got[0].source == f"{with_bom}:1" and got[0].prompt == expected[0].prompt


# ---------------------------------------------------------------------------- tokenizers

def test_char_tokenizer_round_trip_and_save_load(tmp_path):
    tok = build_char_tokenizer()
    ids = tok("23+45=")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(c) for c in "23+45="] and len(ids) == 6
    assert tok.convert_ids_to_tokens([tok.pad_token_id, tok.eos_token_id]) == ["<pad>", "<eos>"]
    assert len(set(tok.convert_tokens_to_ids(list(CHARSET)))) == len(CHARSET)
    text = "Natalia sold 48/2 = 24 clips, $3.50 (10%)!\nThe answer is 72. x , y 'z'"
    assert tok.decode(tok(text)["input_ids"]) == text
    with_specials = ids + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(with_specials, skip_special_tokens=True) == "23+45="
    assert tok.decode(tok("é")["input_ids"]) == "<unk>"

    tok.save_pretrained(tmp_path / "tok")
    for loaded in (AutoTokenizer.from_pretrained(tmp_path / "tok"),
                   load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "tok")))):
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


def test_load_tokenizer_sources(tmp_path):
    assert load_tokenizer(ModelConfig()).get_vocab() == build_char_tokenizer().get_vocab()
    char = load_tokenizer(ModelConfig(hf_path="/nonexistent", tokenizer="char"))
    assert char.eos_token == "<eos>"
    # A saved tokenizer with eos but no pad: pad becomes eos.
    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path / "nopad")
    tok = load_tokenizer(ModelConfig(hf_path=str(tmp_path / "nopad")))
    assert tok.pad_token == "</s>" and tok.pad_token_id == tok.eos_token_id == 1
    with pytest.raises(ConfigError, match=re.escape(f"model.tokenizer: {tmp_path / 'missing'}: "
                                                    "cannot load a tokenizer")):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "missing")))


# ---------------------------------------------------------------------------- prompt datasets

def _examples(*prompts: str) -> list[Example]:
    return [Example(prompt=p, answer="0", solution="0", source=f"t.jsonl:{i + 1}")
            for i, p in enumerate(prompts)]


def test_prompt_dataset_plain_and_too_long():
    tok = build_char_tokenizer()
    ds = PromptDataset(_examples("1+2=", "10*3="), tok, "Q: {question}", False, 9)
    assert len(ds) == 2 and ds.texts == ["Q: 1+2=", "Q: 10*3="]
    assert ds.input_ids == [tok("Q: 1+2=")["input_ids"], tok("Q: 10*3=")["input_ids"]]
    with pytest.raises(ValueError,
                       match=r"t\.jsonl:2: prompt is 8 tokens.*data\.max_prompt_length=7"):
        PromptDataset(_examples("1+2=", "10*3="), tok, "Q: {question}", False, 7)
    with pytest.raises(ValueError, match="empty dataset"):
        PromptDataset([], tok, "{question}", False, 8)
    with pytest.raises(ValueError, match=r"data\.prompt_template"):
        PromptDataset(_examples("1+2="), tok, "{question} {answer}", False, 8)


def test_prompt_dataset_chat_template():
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    ds = PromptDataset(_examples("1+2="), tok, "{question}", True, 32)
    assert ds.texts == ["<user>1+2=\n<assistant>"]
    assert tok.decode(ds.input_ids[0]) == ds.texts[0]
    # The flag off, or no template on the tokenizer: plain text.
    assert PromptDataset(_examples("1+2="), tok, "{question}", False, 32).texts == ["1+2="]
    no_template = build_char_tokenizer()
    assert PromptDataset(_examples("1+2="), no_template, "{question}", True, 32).texts == ["1+2="]


def test_sft_batch():
    tok = build_char_tokenizer()
    examples = [Example("1+2=", "3", "3", "a:1"), Example("10*30=", "300", "300", "a:2")]
    ds = PromptDataset(examples, tok, "{question}", False, 8)
    batch = sft_batch(ds, [1, 0], tok.eos_token_id)
    assert batch["input_ids"].shape == (2, 10) and batch["input_ids"].dtype == torch.long
    assert tok.decode(batch["input_ids"][0]) == "10*30=300<eos>"
    assert tok.decode(batch["input_ids"][1, :6]) == "1+2=3<eos>"
    assert batch["input_ids"][1, 6:].tolist() == [0] * 4
    assert batch["input_lengths"].tolist() == [10, 6]
    assert batch["prompt_lengths"].tolist() == [6, 4]
    assert batch["token_mask"].tolist() == [[0.0] * 6 + [1.0] * 4,
                                            [0.0] * 4 + [1.0] * 2 + [0.0] * 4]
    assert batch["sample_mask"].tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------------- sampler

def test_sampler_epochs_are_seeded_permutations():
    sampler = PromptSampler(num_examples=10, batch_size=5, seed=7)
    epoch0 = sampler.next_batch() + sampler.next_batch()
    epoch1 = sampler.next_batch() + sampler.next_batch()
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    again = PromptSampler(num_examples=10, batch_size=4, seed=7)
    assert sum((again.next_batch() for _ in range(5)), []) == epoch0 + epoch1
    assert PromptSampler(10, 5, seed=8).next_batch() != epoch0[:5]


def test_sampler_resume_equals_straight_run():
    straight = PromptSampler(num_examples=13, batch_size=5, seed=1)
    expected = [straight.next_batch() for _ in range(12)]
    first = PromptSampler(num_examples=13, batch_size=5, seed=1)
    got = [first.next_batch() for _ in range(7)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptSampler(num_examples=13, batch_size=5, seed=1)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(5)]
    assert got == expected
    with pytest.raises(ValueError, match="num_examples=13.*num_examples=14"):
        PromptSampler(num_examples=14, batch_size=5, seed=1).load_state_dict(state)


# ---------------------------------------------------------------------------- load_task

def test_load_task_synthetic_and_gsm8k():
    tok = build_char_tokenizer()
    cfg = DataConfig(task="synthetic", synthetic=SyntheticTaskConfig(num_train=40, num_test=8))
    train, test = load_task(cfg, tok, seed=5)
    assert (len(train), len(test)) == (40, 8)
    assert train.examples == make_synthetic_examples(cfg.synthetic, 5)[0]
    _, no_test = load_task(replace(cfg, synthetic=replace(cfg.synthetic, num_test=0)), tok, seed=5)
    assert no_test is None

    gsm = DataConfig(task="gsm8k", train_path=str(GSM8K_SAMPLE_DIR / "train.jsonl"),
                     test_path=str(GSM8K_SAMPLE_DIR / "test.jsonl"), max_prompt_length=512,
                     prompt_template="Question: {question}\nAnswer:")
    train, test = load_task(gsm, tok, seed=0)
    assert (len(train), len(test)) == (64, 32)
    assert train.texts[0].startswith("Question: Natalia") and train.texts[0].endswith("\nAnswer:")
    assert load_task(replace(gsm, test_path=None), tok, seed=0)[1] is None


@pytest.mark.parametrize("changes,message", [
    ({"task": "mmlu"}, r"data\.task must be one of synthetic, gsm8k, dataset, or a "
                      r"\"module:attribute\" import path \(got 'mmlu'\)"),
    ({"task": "gsm8k"}, r"data\.task=gsm8k needs data\.train_path"),
    ({"task": "gsm8k", "train_path": "/no/such.jsonl"},
     r"data\.train_path: /no/such\.jsonl: no such file"),
    ({"train_path": "x.jsonl"}, r"must be null for data\.task=synthetic"),
    ({"max_prompt_length": 0}, r"data\.max_prompt_length must be >= 1 \(got 0\)"),
    ({"task": "gsm8k", "train_path": str(GSM8K_SAMPLE_DIR / "train.jsonl")},
     r"train\.jsonl:\d+: prompt is \d+ tokens.*data\.max_prompt_length=32"),
])
def test_load_task_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        load_task(replace(DataConfig(), **changes), build_char_tokenizer(), seed=0)
