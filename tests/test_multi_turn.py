"""The multi-turn rollout loop (mcore_rl/rollout/): masks and token counts of an episode against
a hand-built one, tool failures through the loop (a raising tool, a hanging one, megabytes of
output, a hanging environment) as recorded errors and reward 0, the per-call stop tokens of the
hf backend, and the trainer's logprobs of multi-turn sequences against one forward over the
concatenated tokens, in one process, TP=2 and PP=2."""

from __future__ import annotations

import dataclasses
import time
from typing import List

import pytest
import torch

from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.config.schema import GenerationConfig
from mcore_rl.data.example import Example
from mcore_rl.data.tokenizer import build_char_tokenizer
from mcore_rl.environments.base import EpisodeState, StepResult, new_metrics
from mcore_rl.environments.executor import EnvironmentExecutor
from mcore_rl.environments.sandbox import PythonSandbox
from mcore_rl.environments.tool_use import ToolUseEnvironment
from mcore_rl.environments.tools import Calculator
from mcore_rl.generation.base import FinishedGroup, Response
from mcore_rl.rewards.exact import exact_reward as exact_match_reward
from mcore_rl.rollout.multi_turn import ChatFormat, episode_metrics, run_episodes

# A stalled step waits forever; this bound (seconds) only tells one from a slow step on a loaded
# machine (the 2-core CI machine has run these at a load average over 100: 47 s for a 2 s deadline).
STALL = 300

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer():
    """The character tokenizer with ChatML's two special tokens and template."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def ids(tok, text: str) -> List[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedBackend:
    """A backend that answers each call's row ``i`` with ``script[turn][i]`` (text, tokenized),
    logprobs -0.5 per token; records the prompts and stop tokens it got."""

    pad_token_id = 0

    def __init__(self, tok, script: List[List[str]], stop_last: bool = True):
        self.tok, self.script, self.calls = tok, script, []
        self.stop_last = stop_last

    def generate_async(self, prompts, seed, greedy=False, group_size=1, stop_token_ids=None):
        turn = len(self.calls)
        self.calls.append(([list(p) for p in prompts], list(stop_token_ids)))
        out = []
        for i, _ in enumerate(prompts):
            toks = ids(self.tok, self.script[turn][i])
            if self.stop_last:
                toks.append(stop_token_ids[-1])
            out.append(Response(torch.tensor(toks), torch.full((len(toks),), -0.5), False))
        return iter([FinishedGroup(range(len(prompts)), out)])


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "23*45"}}</tool_call>'
EXAMPLE = Example("23*45=", "1035", "1035", "test:0")


def test_masks_and_token_counts_of_a_tool_episode_match_a_hand_built_one():
    tok = chatml_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    env = ToolUseEnvironment(exact_match_reward, (Calculator(),), max_turns=4)
    fmt = ChatFormat(tok, True, env.tool_schemas())
    assert fmt.stop_token_ids == [tok.eos_token_id, im_end]
    prompt = fmt.prompt_ids("23*45=", [])
    backend = ScriptedBackend(tok, [[CALL, CALL], ["1035", "999"]])
    with EnvironmentExecutor(env, num_workers=0) as ex:
        batch, episodes = run_episodes(backend, ex, fmt, [EXAMPLE, EXAMPLE], [prompt, prompt],
                                       seed=3, max_turns=4, max_total_length=1000)
    # By hand: prompt | call <|im_end|> | observation (the template's tool turn) | answer <|im_end|>
    turn1 = ids(tok, CALL) + [im_end]
    obs = ids(tok, '\n<|im_start|>tool\n<tool_response>\n{"result": 1035}\n</tool_response>'
                   '<|im_end|>\n<|im_start|>assistant\n')
    turn2 = ids(tok, "1035") + [im_end]
    expected = prompt + turn1 + obs + turn2
    n = len(expected)
    assert batch["input_ids"][0, :n].tolist() == expected
    mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert batch["token_mask"][0, :n].tolist() == mask
    assert batch["generation_logprobs"][0, :n].tolist() == [-0.5 * m for m in mask]
    assert int(batch["input_lengths"][0]) == n
    assert int(batch["prompt_lengths"][0]) == len(prompt)
    assert int(batch["response_lengths"][0]) == len(turn1) + len(turn2)  # model tokens only
    assert batch["rewards"].tolist() == [1.0, 0.0]
    assert batch["truncated"].tolist() == [0.0, 0.0]
    # The second turn was decoded from the conversation so far, with eos and <|im_end|> as stops.
    assert backend.calls[1][0][0] == prompt + turn1 + obs
    assert backend.calls[1][1] == [tok.eos_token_id, im_end]
    # The loss's token counts (loss.aggregation) exclude observation tokens.
    from mcore_rl.algorithms.losses import valid_token_mask

    batch["sample_mask"] = torch.ones(2)
    assert float(valid_token_mask(batch).sum()) == 2 * len(turn1) + len(turn2) + 4  # "999"+stop
    assert batch["response_lengths"].tolist() == [len(turn1) + len(turn2), len(turn1) + 4]
    m = episode_metrics(episodes)
    assert m["env/turns"] == 2 and m["env/tool_calls"] == 1 and m["env/tool_use_rate"] == 1
    assert m["env/observation_tokens"] == len(obs)
    assert m["env/reward_per_turn"] == pytest.approx(0.25)


def test_plain_text_episode_and_limits():
    """Without a chat template: observations as text + newline; max_turns and
    max_total_length end episodes (truncated), the prompt is the data set's ids."""
    tok = build_char_tokenizer()
    env = ToolUseEnvironment(exact_match_reward, (Calculator(),), max_turns=2)
    fmt = ChatFormat(tok, False, env.tool_schemas())
    assert fmt.stop_token_ids == [tok.eos_token_id]
    prompt = ids(tok, "23*45=")
    backend = ScriptedBackend(tok, [[CALL, CALL], [CALL, CALL]])
    with EnvironmentExecutor(env, num_workers=0) as ex:
        batch, eps = run_episodes(backend, ex, fmt, [EXAMPLE] * 2, [prompt] * 2, seed=0,
                                  max_turns=2, max_total_length=1000)
    obs = ids(tok, '<tool_response>\n{"result": 1035}\n</tool_response>\n')
    assert batch["input_ids"][0, len(prompt) + len(ids(tok, CALL)) + 1:][:len(obs)].tolist() == obs
    assert batch["rewards"].tolist() == [0.0, 0.0]
    assert batch["truncated"].tolist() == [1.0, 1.0]  # tool calls at the last turn
    assert eps[0].metadata["truncated"]
    # A length limit that leaves no room for the observation ends the episode after one turn.
    backend = ScriptedBackend(tok, [[CALL]])
    with EnvironmentExecutor(env, num_workers=0) as ex:
        batch, eps = run_episodes(backend, ex, fmt, [EXAMPLE], [prompt], seed=0, max_turns=2,
                                  max_total_length=len(prompt) + len(ids(tok, CALL)) + 5)
    assert len(backend.calls) == 1 and batch["truncated"].tolist() == [1.0]
    assert int(batch["input_lengths"][0]) == len(prompt) + len(ids(tok, CALL)) + 1


class HangingEnvironment:
    """Hangs in step for the episodes whose prompt says so (past the executor's deadline)."""

    def reset(self, example):
        return None, new_metrics()

    def step(self, state: EpisodeState, text: str) -> StepResult:
        if state.example.prompt == "hang":
            time.sleep(60)
        return StepResult(None, 1.0, True, dict(state.metadata))


def test_failing_tools_and_environments_through_the_loop_never_stall_the_step():
    """A tool that raises, one that hangs past its timeout, one that prints megabytes, and an
    environment that hangs: each a recorded error observation or reward 0, the loop goes on."""
    tok = build_char_tokenizer()
    sandbox = PythonSandbox(timeout_seconds=2.0, cpu_seconds=5, memory_mb=256,
                            max_output_chars=1000)
    env = ToolUseEnvironment(exact_match_reward, (Calculator(), sandbox), max_turns=3)
    fmt = ChatFormat(tok, False, env.tool_schemas())
    code = {"raise": "raise RuntimeError('boom')", "hang": "while True: pass",
            "print": "print('x' * 5_000_000)"}
    calls = [f'<tool_call>{{"name": "python", "arguments": {{"code": "{c}"}}}}</tool_call>'
             for c in code.values()]
    calls.append('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>')
    backend = ScriptedBackend(tok, [calls, ["1035"] * 4])
    start = time.monotonic()
    with EnvironmentExecutor(env, num_workers=1, timeout_seconds=30) as ex:
        batch, eps = run_episodes(backend, ex, fmt, [EXAMPLE] * 4, [ids(tok, "23*45=")] * 4,
                                  seed=0, max_turns=3, max_total_length=4000)
    assert time.monotonic() - start < STALL
    errors = [ep.metadata["tool_errors"] for ep in eps]
    assert errors[0] == 1 and errors[2] == 0 and errors[3] == 1  # raised; printed; 1/0
    assert eps[1].metadata["tool_timeouts"] == 1
    obs_text = [tok.decode(batch["input_ids"][i][batch["token_mask"][i] == 0].tolist())
                for i in range(4)]
    assert "boom" in obs_text[0] and len(obs_text[2]) < 3000  # truncated output
    assert batch["rewards"].tolist() == [1.0] * 4  # the answer after the failed call still counts
    # An environment that hangs: reward 0, env_errors 1, the others unaffected.
    examples = [Example("hang", "1", "1", "t:0"), Example("ok", "1", "1", "t:1")]
    backend = ScriptedBackend(tok, [["1", "1"]])
    start = time.monotonic()
    with EnvironmentExecutor(HangingEnvironment(), num_workers=1, timeout_seconds=2) as ex:
        batch, eps = run_episodes(backend, ex, fmt, examples, [ids(tok, "x=")] * 2, seed=0,
                                  max_turns=2, max_total_length=100)
    assert time.monotonic() - start < STALL
    assert batch["rewards"].tolist() == [0.0, 1.0]
    assert eps[0].metadata["env_errors"] == 1 and episode_metrics(eps)["env/env_errors"] == 0.5


def test_unsafe_sandbox_warns_every_step(caplog):
    """env.sandbox=unsafe_subprocess is never silent: a warning each rollout; bwrap: none."""
    from types import SimpleNamespace

    from mcore_rl.rollout.producer import RolloutProducer

    tok = build_char_tokenizer()
    dataset = SimpleNamespace(examples=[EXAMPLE], input_ids=[ids(tok, EXAMPLE.prompt)])
    for sandbox, warnings in (("unsafe_subprocess", 3), ("bwrap", 0)):
        cfg = load_config("grpo_synthetic", ["env.name=tool_use", "env.num_workers=0",
                                             f"env.sandbox={sandbox}"])
        producer = RolloutProducer(cfg, ScriptedBackend(tok, [["1035"]] * 3), tok, None)
        caplog.clear()
        with caplog.at_level("WARNING"):
            for step in range(3):
                batch = producer.generate(dataset, [0], seed=step)
                assert batch["rewards"].tolist() == [1.0]
        lines = [r.getMessage() for r in caplog.records if "env.sandbox=" in r.getMessage()]
        assert len(lines) == warnings and all("without isolation" in m for m in lines)
        producer.close()


def test_hf_backend_stops_at_per_call_stop_tokens():
    """stop_token_ids ends a row at any of them; without it, the one-turn path is unchanged."""
    from test_generation import PROMPTS, _backend, _reference

    backend = _backend(_reference(), eos=49)
    base = backend.generate(PROMPTS, seed=1)
    again = backend.generate(PROMPTS, seed=1, stop_token_ids=[49])
    for k in base:
        assert torch.equal(base[k], again[k]), k
    row = base["input_ids"][0, len(PROMPTS[0]):int(base["input_lengths"][0])].tolist()
    stop = row[1]  # the second sampled token of row 0 becomes a stop token
    cut = backend.generate(PROMPTS, seed=1, stop_token_ids=[49, stop])
    got = cut["input_ids"][0, len(PROMPTS[0]):int(cut["input_lengths"][0])].tolist()
    assert got == row[:row.index(stop) + 1] and cut["truncated"][0] == 0


@pytest.mark.parametrize("override, needle", [
    (["env.name=tool_use", "grpo.streaming=true", "generation.num_workers=1"],
     "env.name=tool_use (a multi-turn environment) cannot run with grpo.streaming=true"),
    (["env.name=nope"], "env.name"),
    (["env.max_turns=0"], "env.max_turns"),
    (["data.synthetic.tool_solutions=0.5"], "data.synthetic.tool_solutions=0.5 writes"),
    (["env.name=tool_use", "env.step_timeout_seconds=1", "env.tool_timeout_seconds=5"],
     "env.step_timeout_seconds"),
])
def test_bad_env_values_fail_at_load_naming_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config("grpo_synthetic", override)


def test_tool_use_with_a_pretrained_tokenizer_needs_the_chat_template(tmp_path):
    from mcore_rl.config.loader import env_errors

    cfg = load_config("grpo_synthetic", ["env.name=tool_use"])
    assert env_errors(cfg) == []  # the character tokenizer: plain-text turns
    cfg.model.tokenizer = str(tmp_path)
    assert "data.use_chat_template=true" in env_errors(cfg)[0]
    cfg.data.use_chat_template = True
    assert env_errors(cfg) == []


# ------------------------------------------------------------------ logprob parity (Megatron)

class EchoEnvironment:
    """Two observations, then done with reward 1 (for decoding from a random model)."""

    def reset(self, example):
        return None, new_metrics()

    def step(self, state: EpisodeState, text: str) -> StepResult:
        if state.turn >= 2:
            return StepResult(None, 1.0, True, dict(state.metadata))
        return StepResult(f"90{state.turn}", 0.0, False, dict(state.metadata))


class DigitFormat(ChatFormat):
    """Observations as their character ids alone (digits: inside the layout tests' vocabulary)."""

    def observation_ids(self, observation, last_token):
        return ids(self.tokenizer, observation)


@pytest.fixture(scope="module")
def multi_turn_rollout():
    """Multi-turn episodes sampled by the hf backend from the layout tests' initial policy (a
    random model over the layout tests' vocabulary, the character tokenizer's ids)."""
    from test_layouts import ARCH, SEED, VOCAB

    from mcore_rl.generation.hf import HFGenerationBackend
    from mcore_rl.megatron.conversion import arch_to_hf_config
    from mcore_rl.workers.policy import initial_hf_state_dict

    tok = build_char_tokenizer()
    hf_config = arch_to_hf_config(ARCH, VOCAB)
    backend = HFGenerationBackend(hf_config, GenerationConfig(max_new_tokens=6, batch_size=8),
                                  eos_token_id=1, pad_token_id=0, max_total_length=60)
    backend.update_weights(initial_hf_state_dict(hf_config, SEED).items())
    fmt = DigitFormat(tok, False)
    prompts = [[5 + i, 6, 7 + i] for i in range(6)]
    examples = [Example(f"p{i}", "0", "0", f"t:{i}") for i in range(6)]
    with EnvironmentExecutor(EchoEnvironment(), num_workers=0) as ex:
        batch, _ = run_episodes(backend, ex, fmt, examples, prompts, seed=5, max_turns=3,
                                max_total_length=60)
    assert int(batch["input_ids"].max()) < VOCAB
    assert (batch["token_mask"].sum(1) < batch["input_lengths"] - 3).all()  # observations present
    return batch, hf_config


def _logprobs_in_layout(batch, world, megatron):
    from test_layouts import _kwargs

    from mcore_rl.distributed.worker_group import DataParallelGroup, ProcessWorkerGroup
    from mcore_rl.workers.policy import PolicyWorker

    group = ProcessWorkerGroup(PolicyWorker, world, _kwargs(**megatron))
    try:
        return DataParallelGroup(group).gather_rows("get_logprobs", batch, 4)
    finally:
        group.shutdown()


@pytest.mark.parametrize("name, world, megatron", [
    ("one process", 1, {}), ("tp2", 2, dict(tensor_model_parallel_size=2)),
    ("pp2", 2, dict(pipeline_model_parallel_size=2))])
def test_trainer_logprobs_of_multi_turn_episodes_equal_one_forward(multi_turn_rollout, name,
                                                                   world, megatron):
    """The policy's logprobs of the whole episodes (one forward per row over prompt, turns and
    observations) equal the hf backend's per-turn generation logprobs on the model tokens, and a
    transformers forward over the concatenated tokens everywhere, in every layout."""
    from test_layouts import SEED
    from transformers import AutoModelForCausalLM

    from mcore_rl.workers.policy import initial_hf_state_dict

    batch, hf_config = multi_turn_rollout
    got = _logprobs_in_layout(batch, world, megatron)
    mask = batch["token_mask"].bool()
    assert torch.allclose(got[mask], batch["generation_logprobs"][mask], atol=2e-5)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.load_state_dict(initial_hf_state_dict(hf_config, SEED), strict=False)
    model.tie_weights()
    ref = torch.zeros_like(got)
    with torch.no_grad():
        for i in range(batch["input_ids"].shape[0]):
            n = int(batch["input_lengths"][i])
            x = batch["input_ids"][i, :n]
            lp = torch.log_softmax(model(x[None]).logits[0].float(), -1)
            ref[i, 1:n] = lp[:-1].gather(-1, x[1:, None]).squeeze(-1)
    valid = torch.zeros_like(mask)
    for i, n in enumerate(batch["input_lengths"].tolist()):
        valid[i, 1:n] = True
    assert torch.allclose(got[valid], ref[valid], atol=2e-5), name


def test_calculator_warm_start_solution_is_the_loops_episode():
    """data.synthetic.tool_solutions' reference episode tokenizes to what the loop builds from
    the same turns (so the warm start teaches the loop's own format)."""
    from mcore_rl.config.schema import SyntheticTaskConfig
    from mcore_rl.data.synthetic import calculator_solution, make_synthetic_examples

    tok = build_char_tokenizer()
    env = ToolUseEnvironment(exact_match_reward, (Calculator(),), max_turns=3)
    fmt = ChatFormat(tok, False, env.tool_schemas())
    prompt = ids(tok, EXAMPLE.prompt)
    backend = ScriptedBackend(tok, [[CALL], ["1035"]])
    with EnvironmentExecutor(env, num_workers=0) as ex:
        batch, _ = run_episodes(backend, ex, fmt, [EXAMPLE], [prompt], seed=0, max_turns=3,
                                max_total_length=400)
    sft = prompt + ids(tok, calculator_solution(EXAMPLE)) + [tok.eos_token_id]
    assert batch["input_ids"][0].tolist() == sft and batch["rewards"].tolist() == [1.0]
    cfg = SyntheticTaskConfig(operations="*", min_value=10, max_value=99, num_train=200,
                              num_test=20, tool_solutions=0.5)
    train, test = make_synthetic_examples(cfg, 0)
    plain, _ = make_synthetic_examples(dataclasses.replace(cfg, tool_solutions=0.0), 0)
    assert [e.prompt for e in train] == [e.prompt for e in plain]  # same splits
    tools = sum("<tool_call>" in e.solution for e in train)
    assert 70 < tools < 130 and all(e.solution == e.answer for e in test)
