"""What the decoding tests (megatron and vllm backends) share: module fixtures for the peaked
random checkpoint they decode and the eos some of its rows stop at (built from the test
module's ``ARCH``, ``VOCAB``, ``PROMPTS`` and ``PAD``), and the check of a rollout batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcore_rl.megatron.conversion import arch_to_hf_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, request):
    """A Hugging Face checkpoint of the module's ``ARCH`` with seeded weights larger than HF's
    init, so next-token distributions are peaked (greedy ties are unlikely, eos is reachable)."""
    path = tmp_path_factory.mktemp("hf")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            arch_to_hf_config(request.module.ARCH, request.module.VOCAB), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def eos(checkpoint, request):
    """As eos, the third token of the module's prompt 0's free greedy response: some rows stop
    at it."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        return int(model.generate(torch.tensor([request.module.PROMPTS[0]]), do_sample=False,
                                  max_new_tokens=3, eos_token_id=None,
                                  pad_token_id=request.module.PAD)[0, -1])


def check_rollout(batch, prompts, eos: int, pad: int, max_new_tokens: int, max_total: int) -> None:
    """Prompts kept, right padding, masks, eos/truncation and budgets consistent."""
    for i, prompt in enumerate(prompts):
        p, r = len(prompt), int(batch["response_lengths"][i])
        n = int(batch["input_lengths"][i])
        assert n == p + r and 1 <= r <= min(max_new_tokens, max_total - p)
        assert batch["input_ids"][i, :p].tolist() == prompt and (batch["input_ids"][i, n:] == pad).all()
        assert batch["token_mask"][i].sum() == r and batch["token_mask"][i, p:n].all()
        response = batch["input_ids"][i, p:n].tolist()
        assert eos not in response[:-1]
        assert bool(batch["truncated"][i]) == (response[-1] != eos)
        if response[-1] != eos:
            assert r == min(max_new_tokens, max_total - p)
