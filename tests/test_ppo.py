"""PPO pieces: the clipped value loss, token-level rewards, explained variance, the advantage
pipeline of the PPO controller (returns before whitening), PPO config validation and the CLI
dispatch; a checkpoint saved before the optimizer's first step (the policy during critic
warm-up) resumes exactly; and PPO end to end on the GSM8K pipeline from a small random Qwen2
checkpoint, resumed after a critic warm-up step."""

from __future__ import annotations

import contextlib
import json
import threading
import types
from pathlib import Path

import pytest
import torch

from mcore_rl.algorithms.advantages import gae, masked_whiten
from mcore_rl.algorithms.losses import ClippedValueLoss
from mcore_rl.algorithms.ppo import explained_variance, token_level_rewards
from mcore_rl.cli import main
from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.config.schema import OptimizerConfig, PPOConfig, ValueLossConfig
from mcore_rl.data.batch import select

T = torch.tensor


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected, dtype=torch.float32),
                               rtol=tol, atol=tol)


# --------------------------------------------------------------------------- value loss

def value_batch():
    """Row 0: prompt t=0,1, response t=2..4; row 1 dropped (sample_mask 0); row 2: t=1..2."""
    mask = T([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    values = T([[0.0, 9.0, 1.0, 0.5, 2.0], [0.0, 5.0, 5.0, 5.0, 5.0], [0.0, 0.1, -1.0, 7.0, 7.0]])
    old = T([[0.0, 0.0, 0.5, 0.4, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -0.5, 0.0, 0.0]])
    returns = T([[0.0, 0.0, 0.0, 1.0, 1.0], [0.0, 1e4, 1e4, 1e4, 1e4], [0.0, 1.0, 0.0, 0.0, 0.0]])
    batch = {"token_mask": mask, "sample_mask": T([1.0, 0.0, 1.0]), "returns": returns, "prev_values": old}
    return values, batch


def test_value_loss_hand_values_and_metrics():
    # eps = 0.2. Row 0: t=2 V=1, clip to [0.3,0.7] -> 0.7: (1-0)^2=1 vs 0.49 -> 1 (unclipped larger)
    #                   t=3 V=.5 in [.2,.6]: (.5-1)^2 = .25 both
    #                   t=4 V=2 -> Vc=1.2: (2-1)^2=1 vs .04 -> 1
    # Row 2: t=1 V=.1, old 0 -> Vc=.1: (.1-1)^2 = .81 both
    #        t=2 V=-1, old -.5 -> Vc=-.7: 1 vs .49 -> 1
    # Row 1 (dropped) never counts. No token has the clipped error strictly larger.
    values, batch = value_batch()
    fn = ClippedValueLoss(ValueLossConfig(cliprange=0.2, coef=2.0))
    loss_sum, count, m = fn(values, batch)
    close(loss_sum, 2.0 * 0.5 * (1 + 0.25 + 1 + 0.81 + 1))
    close(count, 5.0)
    close(m["vf_clipfrac"], 0.0)
    close(m["value_mean"], 1.0 + 0.5 + 2.0 + 0.1 - 1.0)
    close(m["num_valid_tokens"], 5.0)
    close(m["num_valid_sequences"], 2.0)
    assert fn.loss_type == "token" and set(m) <= set(fn.metric_kinds)


def test_value_loss_clip_cuts_the_gradient():
    # Row 0 t=2: V = 1, old = 0.5, R = 2: unclipped (1-2)^2 = 1; Vc = 0.7: (0.7-2)^2 = 1.69
    # -> clipped term is larger: loss 0.5 * 1.69, zero gradient (Vc is constant in V).
    # Row 0 t=3: V = 0.5, R = 1, inside: loss 0.5 * 0.25, dL/dV = V - R = -0.5.
    values, batch = value_batch()
    batch["returns"][0, 2] = 2.0
    values.requires_grad_(True)
    fn = ClippedValueLoss(ValueLossConfig(cliprange=0.2, coef=1.0))
    loss_sum, _, m = fn(values, batch)
    close(loss_sum, 0.5 * (1.69 + 0.25 + 1 + 0.81 + 1))
    close(m["vf_clipfrac"], 1.0)
    (grad,) = torch.autograd.grad(loss_sum, values)
    expected = torch.zeros(3, 5)
    expected[0, 3], expected[0, 4] = -0.5, 1.0
    expected[2, 1], expected[2, 2] = -0.9, -1.0
    close(grad, expected)


def test_value_loss_unclipped_and_random_against_formula():
    g = torch.Generator().manual_seed(0)
    values, old, ret = (torch.randn(4, 7, generator=g) for _ in range(3))
    mask = (torch.rand(4, 7, generator=g) > 0.3).float()
    batch = {"token_mask": mask, "sample_mask": torch.ones(4), "returns": ret, "prev_values": old}
    m = mask.clone()
    m[:, 0] = 0
    for eps in (None, 0.3):
        loss, count, _ = ClippedValueLoss(ValueLossConfig(cliprange=eps, coef=0.5))(values, batch)
        err = (values - ret) ** 2
        if eps is not None:
            err = torch.maximum(err, (old + (values - old).clamp(-eps, eps) - ret) ** 2)
        close(loss, 0.5 * 0.5 * (err * m).sum())
        close(count, m.sum())


def test_value_loss_microbatches_sum_to_the_whole():
    values, batch = value_batch()
    fn = ClippedValueLoss(ValueLossConfig(cliprange=0.2))
    whole = fn(values, batch)
    parts = [fn(values[i:i + 1], select(batch, slice(i, i + 1))) for i in range(3)]
    close(sum(p[0] for p in parts), whole[0])
    close(sum(p[1] for p in parts), whole[1])


def test_value_loss_errors():
    values, batch = value_batch()
    with pytest.raises(ValueError, match="value.loss.cliprange"):
        ClippedValueLoss(ValueLossConfig(cliprange=0.0))
    with pytest.raises(ValueError, match="value.loss.coef"):
        ClippedValueLoss(ValueLossConfig(coef=0.0))
    fn = ClippedValueLoss(ValueLossConfig())
    with pytest.raises(ValueError, match="'returns'"):
        fn(values, {k: v for k, v in batch.items() if k != "returns"})
    with pytest.raises(ValueError, match=r"batch\['prev_values'\] has shape \(3, 4\)"):
        fn(values, dict(batch, prev_values=batch["prev_values"][:, :4]))


# --------------------------------------------------------------------------- token rewards

def test_token_rewards_outcome_at_last_token_and_kl_penalty():
    mask = T([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    kl = torch.arange(18, dtype=torch.float32).view(3, 6) / 10
    r = token_level_rewards(T([1.0, -2.0, 5.0]), mask)
    close(r, [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, -2], [0] * 6])  # a row with no token: nothing
    r = token_level_rewards(T([1.0, -2.0, 5.0]), mask, kl, kl_coef=0.5)
    close(r, [[0, -0.05, -0.1, 0, 1 - 0.2, 0],
              [0, 0, -0.4, -0.45, -0.5, -2 - 0.55],
              [0] * 6])


def test_token_rewards_errors():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs kl"):
        token_level_rewards(torch.ones(2), mask, None, kl_coef=0.1)
    with pytest.raises(ValueError, match="ppo.reward_kl_coef"):
        token_level_rewards(torch.ones(2), mask, torch.zeros(2, 3), kl_coef=-1.0)
    with pytest.raises(ValueError, match=r"rewards must be \[B\]"):
        token_level_rewards(torch.ones(3), mask)


def test_explained_variance():
    g = torch.Generator().manual_seed(0)
    ret = torch.randn(3, 8, generator=g)
    mask = (torch.rand(3, 8, generator=g) > 0.3).float()
    values = ret + 0.5 * torch.randn(3, 8, generator=g)
    sel = mask.bool()
    expected = 1 - (ret[sel] - values[sel]).var() / ret[sel].var()
    assert explained_variance(values, ret, mask) == pytest.approx(float(expected), rel=1e-6)
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 3.0), ret, mask) == pytest.approx(0.0, abs=1e-6)
    assert explained_variance(values, torch.ones_like(ret), mask) != explained_variance(values, ret, mask)
    with pytest.raises(ValueError, match="explained_variance"):
        explained_variance(values, ret[:, :4], mask)


def test_ppo_advantages_take_returns_before_whitening():
    from mcore_rl.controller.ppo import PPO

    g = torch.Generator().manual_seed(1)
    mask = T([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    rollout = {"token_mask": mask, "sample_mask": torch.ones(2), "rewards": T([1.0, 0.0]),
               "prev_logprobs": -torch.rand(2, 6, generator=g), "prev_values": torch.randn(2, 6, generator=g)}
    rollout["reference_logprobs"] = rollout["prev_logprobs"] - 0.1
    cfg = PPOConfig(gamma=0.9, lam=0.8, reward_kl_coef=0.2, reward_kl_estimator="k1")
    algorithm = types.SimpleNamespace(cfg=types.SimpleNamespace(ppo=cfg))
    PPO.compute_advantages(algorithm, rollout)
    metrics = PPO.critic_metrics(algorithm, rollout)
    # k1 = logp - ref = 0.1 per token: -0.02 on every response token, outcome at the end.
    close(rollout["token_rewards"], [[0, 0, -0.02, -0.02, 1 - 0.02, 0], [0, -0.02, -0.02, -0.02, -0.02, -0.02]])
    adv, ret = gae(rollout["token_rewards"], rollout["prev_values"], mask, 0.9, 0.8)
    close(rollout["returns"], ret * mask)
    close(rollout["advantages"], masked_whiten(adv, mask) * mask)
    assert metrics["critic/explained_variance"] == pytest.approx(
        explained_variance(rollout["prev_values"], ret, mask), rel=1e-6)
    # Monte Carlo returns (gamma = 0.9, lam = 1): the discounted reward-to-go, by a direct sum
    r = rollout["token_rewards"]
    mc = torch.stack([sum(0.9 ** (k - t) * r[:, k] for k in range(t, 6)) for t in range(6)], dim=1)
    assert metrics["critic/explained_variance_mc"] == pytest.approx(
        explained_variance(rollout["prev_values"], mc, mask), rel=1e-5)
    assert metrics["critic/explained_variance_mc"] != pytest.approx(metrics["critic/explained_variance"])
    assert metrics["train/reward_kl"] == pytest.approx(0.1, rel=1e-5)


# --------------------------------------------------------------------------- config and CLI

def test_ppo_configs_compose():
    cfg = load_config("ppo_synthetic")
    assert cfg.algorithm == "ppo" and cfg.ppo.num_generations >= 1
    assert load_config("ppo_gsm8k").algorithm == "ppo"


@pytest.mark.parametrize("overrides, message", [
    (["cluster.num_workers=3", "value.megatron.tensor_model_parallel_size=2"],
     "must be divisible by value.megatron.tensor_model_parallel_size"),
    (["ppo.lam=1.5"], "ppo.lam must be in [0, 1]"),
    (["ppo.num_prompts_per_step=6", "ppo.num_mini_batches=4"], "must be divisible by ppo.num_mini_batches"),
    (["value.loss.cliprange=-1"], "value.loss.cliprange must be null or > 0"),
    (["ppo.reward_kl_estimator=k5"], "ppo.reward_kl_estimator must be one of"),
    (["algorithm=dpo"], "algorithm must be one of grpo, ppo"),
])
def test_ppo_config_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config("ppo_synthetic", overrides)
    assert message in str(info.value)


def test_value_layout_is_checked_only_for_ppo():
    cfg = load_config("grpo_synthetic", ["cluster.num_workers=3", "value.megatron.tensor_model_parallel_size=2"])
    assert cfg.algorithm == "grpo"


def test_cli_train_dispatches_on_algorithm(monkeypatch):
    """``mcore-rl train`` runs :func:`mcore_rl.controller.loops.run`, whose loop is built with
    the algorithm ``algorithm`` names (config/registry.py ALGORITHMS)."""
    from mcore_rl.controller import loops
    from mcore_rl.controller.grpo import GRPO
    from mcore_rl.controller.ppo import PPO

    calls = []
    monkeypatch.setattr(loops, "run", lambda cfg: calls.append(type(loops.algorithm(cfg))))
    assert main(["train", "--config-name", "ppo_synthetic"]) == 0
    assert main(["train", "--config-name", "grpo_synthetic"]) == 0
    assert calls == [PPO, GRPO]


# --------------------------------------------------------------------------- checkpoints

def _resume_before_first_step(ckpt_dir):
    """A worker saved before its optimizer's first step (as the policy is while the critic
    warms up: Megatron then has no Adam state to save), restored into a worker that starts
    elsewhere and has stepped (weights, moments and schedule all differ); one more step on
    both. Returns both weights after that step."""
    from test_value_worker import _batch, _train_step, _worker

    adam = OptimizerConfig(lr=1e-2, clip_grad=1.0)
    straight = _worker(optimizer=adam)
    straight.save_checkpoint(ckpt_dir)
    restored = _worker(optimizer=adam, seed=8)
    _train_step(restored, _batch(seed=2), lambda b: b)
    restored.load_checkpoint(ckpt_dir)
    batch = _batch(seed=1)
    for worker in (straight, restored):
        _train_step(worker, batch, lambda b: b)
    return straight.get_hf_weights(), restored.get_hf_weights()


def test_checkpoint_before_first_optimizer_step_resumes_with_fresh_optimizer(tmp_path):
    from dist_utils import run_distributed

    straight, restored = run_distributed(_resume_before_first_step, 1, str(tmp_path / "ckpt"))[0]
    assert straight.keys() == restored.keys()
    for k in straight:  # Adam's first step: equal only with the weights and no stale moments
        torch.testing.assert_close(restored[k], straight[k], rtol=0, atol=0, msg=k)


# --------------------------------------------------------------------------- end to end

@pytest.fixture()
def qwen2_checkpoint(tmp_path):
    """A small random-weight Qwen2 checkpoint (untied embeddings) with the character tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mcore_rl.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1100,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    path = tmp_path / "qwen2-tiny"
    Qwen2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_ppo_gsm8k_two_steps_from_hf_checkpoint_with_resume(qwen2_checkpoint, tmp_path):
    from mcore_rl.utils.logging import read_metrics

    out = tmp_path / "run"
    overrides = [
        f"model.hf_path={qwen2_checkpoint}", f"run.output_dir={out}", "cluster.use_ray=false",
        "cluster.device=cpu", "ppo.num_prompts_per_step=2", "ppo.num_mini_batches=2", "ppo.ppo_epochs=1",
        "ppo.reward_kl_coef=0.05", "ppo.val_every=2", "ppo.val_num_prompts=1", "generation.max_new_tokens=8",
        "data.max_prompt_length=1024", "data.max_total_length=1032", "logging.progress=false",
        "checkpoint.every=1", "ppo.critic_warmup_steps=1",
        "data.use_chat_template=false",  # the character tokenizer has no chat template
    ]
    assert main(["train", "--config-name", "ppo_gsm8k", "ppo.max_steps=1", *overrides]) == 0
    # the second step resumes policy and critic from step 1's checkpoint
    assert main(["train", "--config-name", "ppo_gsm8k", "ppo.max_steps=2", "checkpoint.resume=latest",
                 *overrides]) == 0
    assert (out / "checkpoints" / "step_2" / "value").is_dir()
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["train/reward_errors"] == 0
        assert r["train/logprob_mismatch_max"] < 1e-4
        assert r["critic/grad_norm"] > 0
        assert r["train/reward_kl"] == 0  # step 1 trains the critic only: the policy is the reference
    assert "train/grad_norm" not in records[1] and "refit/seconds" not in records[1]
    assert records[2]["train/grad_norm"] > 0  # the resumed run counts the warm-up step as done
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "val_accuracy_end" in summary
    assert Path(out / "tokenizer" / "tokenizer.json").is_file()


def test_separate_placement_trains_critic_and_policy_at_once():
    """The critic's and the policy's updates of a PPO step depend on the rollout only: with
    cluster.placement=separate every critic update is sent before the policy's first (the
    critic's GPUs work while the policy trains), colocated they alternate; each update gets the
    same mini-batch either way and the step's metrics are the same."""
    from concurrent.futures import Future

    from mcore_rl.controller.loops import algorithm

    def run(placement):
        cfg = load_config("ppo_synthetic", [f"cluster.placement={placement}", "ppo.ppo_epochs=2",
                                            "ppo.num_mini_batches=2", "ppo.critic_warmup_steps=0"])
        alg = algorithm(cfg)
        events, pending = [], []

        class Critic:
            def train_async(self, part, loss_fn, micro_batch_size):
                events.append(("critic", part["row"].tolist()))
                f = Future()
                pending.append((f, float(part["row"].float().mean())))
                if placement == "colocated":  # answered at once: the loop waits for each
                    f.set_result({"loss": pending[-1][1]})
                else:  # answered after the policy's last update, or 5 s on (a waiting loop
                    # then fails the order assertions below instead of hanging)
                    answer = lambda f=f, loss=pending[-1][1]: f.done() or f.set_result({"loss": loss})  # noqa: E731
                    timer = threading.Timer(5.0, answer)
                    timer.daemon = True
                    timer.start()
                return f

        class Trainer:
            step, groups = 3, {"value": Critic()}
            timer = type("T", (), {"phase": staticmethod(lambda name: contextlib.nullcontext())})()

            @staticmethod
            def train_policy(part, loss_fn):
                events.append(("policy", part["row"].tolist()))
                if placement == "separate":
                    assert not any(f.done() for f, _ in pending)  # the critic still works
                    if len(pending) == sum(e[0] == "policy" for e in events) == 4:
                        for f, loss in pending:  # the critic answers after the policy's last
                            if not f.done():
                                f.set_result({"loss": loss})
                return {"loss": -float(part["row"].float().mean())}

        rollout = {"row": torch.arange(8)}
        return events, alg.train_step(Trainer(), rollout)

    (seq, seq_metrics), (both, both_metrics) = run("colocated"), run("separate")
    assert [kind for kind, _ in seq] == ["critic", "policy"] * 4
    assert [kind for kind, _ in both] == ["critic"] * 4 + ["policy"] * 4
    assert [rows for kind, rows in both if kind == "critic"] == [rows for kind, rows in seq if kind == "critic"]
    assert [rows for kind, rows in both if kind == "policy"] == [rows for kind, rows in seq if kind == "policy"]
    assert both_metrics == seq_metrics and set(both_metrics) == {"critic/loss", "train/loss"}


def test_colocated_critic_warmup_hands_the_device_back_before_generating(tmp_path):
    """Colocated PPO with a critic warm-up step: the warm-up trains the critic only (no
    refit), and still the next RL step generates with the rollout backend awake and the
    policy off the device (``Colocation.prepare_for_generation`` at the step's end); the
    backend then sleeps again before the logprobs. The backend's hooks (hf: no-ops on CPU) and
    the policy's calls are spied on, in order."""
    from mcore_rl.controller.loops import build
    from mcore_rl.utils.logging import read_metrics

    out = tmp_path / "run"
    cfg = load_config("ppo_synthetic", [
        "cluster.use_ray=false", "cluster.colocate_generation=true", "ppo.max_steps=2",
        "ppo.critic_warmup_steps=1", "ppo.num_prompts_per_step=4", "ppo.ppo_epochs=1",
        "ppo.val_every=0", "ppo.val_at_start=false", "sft.steps=0", "checkpoint.every=0",
        "checkpoint.save_final=false", "logging.progress=false", "logging.tensorboard=false",
        "data.synthetic.num_train=12", "data.synthetic.num_test=2",
        "model.arch.num_layers=2", "model.arch.hidden_size=32", "model.arch.ffn_hidden_size=64",
        "policy.micro_batch_size=2", "value.micro_batch_size=2",
        "generation.logprob_canary_prompts=0", f"run.output_dir={out}"])
    loop = build(cfg)
    tr, events = loop.trainer, []
    backend, awake = tr.generation, {"kv": True}

    def spy(name, state=None):
        original = getattr(backend, name)

        def hook(*args, **kwargs):
            events.append(f"engine.{name}")
            if state is not None:
                awake["kv"] = state
            return original(*args, **kwargs)
        setattr(backend, name, hook)

    spy("offload", False)
    spy("prepare_for_refit")
    spy("prepare_for_generation", True)
    generate = backend.generate_async

    def generate_async(*args, **kwargs):
        events.append("generate" if awake["kv"] else "generate (backend asleep)")
        return generate(*args, **kwargs)
    backend.generate_async = generate_async
    group = tr.policy.group
    send = group.call_each_async
    group.call_each_async = lambda method, *a, **k: events.append(method) or send(method, *a, **k)
    try:
        loop.fit()
    finally:
        loop.close()
    rows = [r for r in read_metrics(out) if "critic/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert "train/loss" not in rows[0] and "refit/seconds" not in rows[0]
    assert "train/loss" in rows[1] and "refit/seconds" in rows[1]
    generations = [i for i, e in enumerate(events) if e.startswith("generate")]
    assert [events[i] for i in generations] == ["generate", "generate"], events
    # the second rollout: after the warm-up's logprobs, the policy yields and the engine wakes
    between = events[generations[0]:generations[1]]
    assert "get_hf_weights" not in between  # no refit
    assert between[-3:] == ["offload_after_refit", "engine.prepare_for_refit",
                            "engine.prepare_for_generation"], between
    # and it sleeps again before the policy's logprobs of that rollout
    after = events[generations[1]:]
    assert after.index("engine.offload") < after.index("prepare_for_lp_inference"), after
