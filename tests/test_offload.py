"""Offload lifecycle and its guard (CPU, one gloo process spawned once for the module), bf16
wrapping, the controller's call order, and ``cluster.offload_train_state=false`` against true
in two colocated RL steps (the same rewards, losses and weights; no policy state moved).

Two policy workers with the same start take the same two train steps; one of them goes
through ``offload_before_refit`` -> refit export -> ``offload_after_refit`` -> guarded calls
-> ``prepare_for_lp_inference`` -> ``prepare_for_training`` between the steps. On CPU the
offload is the same storage-level code as on GPU (host copies, storages freed to 0 bytes), so
the weights and Adam state that come back must give bit-identical parameters after the next
step. Every guarded method must raise a ``RuntimeError`` that names it and the prepare step
the caller skipped, without reaching the model (its forward is patched to raise).
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace

import pytest
import torch
from dist_utils import _WORLD, run_distributed

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.schema import LossConfig, MegatronConfig
from mcore_rl.data import batch as B
from test_policy_worker import ARCH, VOCAB, _kwargs, _rollout

LOSS = ClippedPGLoss(LossConfig(kl_coef=0.05))
TRAIN = "prepare_for_training()"
INFER = "prepare_for_lp_inference()"


def _policy(**megatron):
    from mcore_rl.workers.policy import PolicyWorker

    kw = _kwargs(**megatron)
    return PolicyWorker(**kw, rank=0, world_size=1, master_addr="127.0.0.1",
                        master_port=_WORLD["port"])


def _step(worker, batch):
    batch = dict(batch, prev_logprobs=worker.get_logprobs(batch, 4),
                 reference_logprobs=worker.get_reference_logprobs(batch, 4))
    return worker.train(batch, LOSS, B.batch_size(batch), 2)


def _error(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _device_bytes(worker) -> dict:
    """Bytes still held by the storages the lifecycle moves (0 = freed)."""
    grads = {b.grad_data.untyped_storage().data_ptr(): b.grad_data.untyped_storage().nbytes()
             for m in worker.model for b in m.buffers}
    return {
        "weights": sum(t.untyped_storage().nbytes() for t in worker._weight_tensors()),
        "grads": sum(grads.values()),
        "optimizer": sum(t.untyped_storage().nbytes() for t in worker._optimizer_tensors()),
    }


def _guarded_calls(worker, batch):
    """Each guarded public method with valid arguments -> the prepare step it must name."""
    return {
        "train": (lambda: worker.train(batch, LOSS, B.batch_size(batch), 2), TRAIN),
        "begin_train_step": (lambda: worker.begin_train_step(LOSS, 8, 2), TRAIN),
        "train_microbatch": (lambda: worker.train_microbatch(batch), TRAIN),
        "finish_train_step": (lambda: worker.finish_train_step(), TRAIN),
        "rebuild_optimizer": (lambda: worker.rebuild_optimizer(), TRAIN),
        "save_checkpoint": (lambda: worker.save_checkpoint("/nonexistent/ckpt"), TRAIN),
        "get_logprobs": (lambda: worker.get_logprobs(batch, 4), INFER),
        "get_reference_logprobs": (lambda: worker.get_reference_logprobs(batch, 4), INFER),
        "set_reference_to_current": (lambda: worker.set_reference_to_current(), INFER),
        "get_hf_weights": (lambda: worker.get_hf_weights(), INFER),
    }


def _lifecycle_checks() -> dict:
    from megatron.core.utils import unwrap_model

    out = {}
    batch = _rollout(8, seed=1)
    plain, lifecycle, dropping = _policy(), _policy(), _policy()
    out["weights_start"] = plain.get_hf_weights()
    _step(plain, batch)
    _step(lifecycle, batch)
    _step(dropping, batch)
    out["bytes_start"] = _device_bytes(lifecycle)
    # cluster.offload_train_state=grads: the gradient buffers alone leave, and come back zeroed
    dropping.drop_grad_buffers()
    dropping.drop_grad_buffers()  # idempotent
    out["grads_bytes_dropped"] = _device_bytes(dropping)
    out["grads_train_error"] = _error(lambda: dropping.train(batch, LOSS, 8, 2))
    out["grads_refit_equal"] = all(torch.equal(a, b) for a, b in zip(
        dropping.get_hf_weights().values(), plain.get_hf_weights().values()))
    out["grads_logprobs_equal"] = torch.equal(dropping.get_logprobs(batch, 4),
                                              plain.get_logprobs(batch, 4))
    dropping.prepare_for_training()
    out["grads_bytes_training"] = _device_bytes(dropping)
    out["plain_weights_step1"] = plain.get_hf_weights()  # what the refit must read

    lifecycle.offload_before_refit()
    out["flags_before_refit"] = (lifecycle._weights_offloaded, lifecycle._train_state_offloaded)
    out["bytes_before_refit"] = _device_bytes(lifecycle)
    out["refit_weights"] = lifecycle.get_hf_weights()  # the refit reads the weights now
    out["train_error_before_refit"] = _error(lambda: lifecycle.train(batch, LOSS, 8, 2))
    lifecycle.offload_after_refit()
    lifecycle.offload_after_refit()  # idempotent
    out["flags_after_refit"] = (lifecycle._weights_offloaded, lifecycle._train_state_offloaded)
    out["bytes_after_refit"] = _device_bytes(lifecycle)

    chunk = unwrap_model(lifecycle.model[0])
    reached = []

    def forward_must_not_run(*args, **kwargs):
        reached.append(True)
        raise AssertionError("the model's forward ran while offloaded")

    chunk.forward = forward_must_not_run
    out["guard_errors"] = {name: (_error(call), prepare)
                           for name, (call, prepare) in _guarded_calls(lifecycle, batch).items()}
    out["forward_reached"] = bool(reached)
    del chunk.forward

    lifecycle.prepare_for_lp_inference()
    out["flags_lp_inference"] = (lifecycle._weights_offloaded, lifecycle._train_state_offloaded)
    out["logprobs_equal"] = torch.equal(lifecycle.get_logprobs(batch, 4), plain.get_logprobs(batch, 4))
    out["train_error_lp_inference"] = _error(lambda: lifecycle.train(batch, LOSS, 8, 2))
    lifecycle.prepare_for_training()
    out["flags_training"] = (lifecycle._weights_offloaded, lifecycle._train_state_offloaded)
    out["bytes_training"] = _device_bytes(lifecycle)

    batch2 = _rollout(8, seed=2)
    out["metrics"] = (_step(plain, batch2), _step(lifecycle, batch2))
    out["grads_metrics"] = _step(dropping, batch2)
    out["weights"] = (plain.get_hf_weights(), lifecycle.get_hf_weights())
    out["grads_weights"] = dropping.get_hf_weights()
    # a whole offload after a drop moves the optimizer state too, and one prepare restores both
    dropping.drop_grad_buffers()
    dropping.offload_before_refit()
    out["grads_then_offload_bytes"] = _device_bytes(dropping)
    dropping.prepare_for_training()
    out["grads_then_offload_flags"] = (dropping._grads_dropped, dropping._train_state_offloaded)
    out["reference_equal"] = torch.equal(plain.get_reference_logprobs(batch2, 4),
                                         lifecycle.get_reference_logprobs(batch2, 4))

    # keep_train_buffers=True brings everything back at once
    lifecycle.offload_after_refit()
    lifecycle.prepare_for_lp_inference(keep_train_buffers=True)
    out["flags_keep_buffers"] = (lifecycle._weights_offloaded, lifecycle._train_state_offloaded)
    # an open split step refuses to be offloaded (its gradients would be lost)
    lifecycle.begin_train_step(LOSS, 8, 2)
    out["offload_during_split_step"] = _error(lifecycle.offload_before_refit)
    lifecycle.abort_train_step()
    out["value_worker"] = _value_worker_checks(batch)
    return out


def _value_worker_checks(batch) -> dict:
    from mcore_rl.config.schema import OptimizerConfig
    from mcore_rl.workers.value import ValueWorker

    kw = {k: v for k, v in _kwargs().items() if k not in ("temperature", "use_reference")}
    value = ValueWorker(**dict(kw, optimizer=OptimizerConfig(name="sgd", lr=0.1)), rank=0,
                        world_size=1, master_addr="127.0.0.1", master_port=_WORLD["port"])
    before = value.get_values(batch, 4)
    value.offload_after_refit()
    error = _error(lambda: value.get_values(batch, 4))
    value.prepare_for_lp_inference()
    return {"error": error, "values_equal": torch.equal(before, value.get_values(batch, 4))}


def _bf16_checks() -> dict:
    """``wrap_float16`` on CPU: bf16 params, deliberately fp32 params kept exactly, the HF
    conversion sees through the wrapper, fp32 output close to the fp32 model's."""
    from megatron.core.transformer.module import Float16Module

    from mcore_rl.megatron.conversion import export_hf_weights, load_hf_weights
    from mcore_rl.megatron.model import attention_mask, build_model, position_ids, wrap_float16
    from mcore_rl.workers.policy import initial_hf_state_dict
    from mcore_rl.megatron.conversion import arch_to_hf_config

    state = initial_hf_state_dict(arch_to_hf_config(ARCH, VOCAB), seed=3)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = {}
    for precision in ("fp32", "bf16"):
        megatron = MegatronConfig(precision=precision, layer_spec="torch")
        (wrapped,) = wrap_float16(build_model(ARCH, megatron, VOCAB, "cpu"), precision)
        load_hf_weights([wrapped], state, ARCH)
        with torch.no_grad():
            logits[precision] = wrapped(ids, position_ids(2, 9), attention_mask("torch", 2, 9, "cpu"))
    exported = dict(export_hf_weights([wrapped], ARCH, VOCAB))
    # a parameter that is fp32 on purpose in a bf16 model (a value head) stays fp32, exactly
    (chunk,) = build_model(ARCH, MegatronConfig(precision="bf16"), VOCAB, "cpu")
    fp32_extra = torch.nn.Parameter(torch.full((3,), 1 + 2.0 ** -20))  # not a bf16 value
    fp32_extra.keep_fp32 = True
    chunk.register_parameter("fp32_extra", fp32_extra)
    (with_extra,) = wrap_float16([chunk], "bf16")
    dtypes = {n: p.dtype for n, p in with_extra.named_parameters()}
    return {
        "is_float16_module": isinstance(wrapped, Float16Module),
        "dtypes": dtypes,
        "extra_value_kept": torch.equal(fp32_extra.data, torch.full((3,), 1 + 2.0 ** -20)),
        "export_equal_bf16": all(torch.equal(exported[k], v.to(torch.bfloat16)) for k, v in state.items()
                                 if k in exported),
        "export_names": sorted(exported) == sorted(state),
        "output_dtype": logits["bf16"].dtype,
        "logit_diff": (logits["bf16"] - logits["fp32"]).abs().max().item(),
        "logit_max": logits["fp32"].abs().max().item(),
    }


def _all_checks() -> dict:
    return {"lifecycle": _lifecycle_checks(), "bf16": _bf16_checks()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_checks, 1)[0]


def test_flags_follow_the_lifecycle(results):
    r = results["lifecycle"]
    assert r["flags_before_refit"] == (False, True)
    assert r["flags_after_refit"] == (True, True)
    assert r["flags_lp_inference"] == (False, True)
    assert r["flags_training"] == (False, False)
    assert r["flags_keep_buffers"] == (False, False)


def test_offload_frees_weights_grads_and_optimizer_state(results):
    r = results["lifecycle"]
    start = r["bytes_start"]
    assert all(v > 0 for v in start.values()), start
    before = r["bytes_before_refit"]
    assert before["weights"] == start["weights"] and before["grads"] == 0 and before["optimizer"] == 0
    assert r["bytes_after_refit"] == {"weights": 0, "grads": 0, "optimizer": 0}
    assert r["bytes_training"] == start


def test_refit_reads_the_trained_weights_between_the_offloads(results):
    # between offload_before_refit and offload_after_refit the export must give the weights of
    # the step just taken: those of the worker that took it without any offload
    r = results["lifecycle"]
    refit, plain = r["refit_weights"], r["plain_weights_step1"]
    assert refit.keys() == plain.keys() and len(plain) > 0
    for k in plain:
        torch.testing.assert_close(refit[k], plain[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    # the step moved them, so the weights before it (stale ones) would not pass
    assert any(not torch.equal(plain[k], v) for k, v in r["weights_start"].items())


def test_every_guarded_method_names_itself_and_the_prepare_step(results):
    r = results["lifecycle"]
    assert not r["forward_reached"]
    for method, (message, prepare) in r["guard_errors"].items():
        assert message.startswith(f"{method}: "), message
        assert prepare in message, (method, message)
        other = INFER if prepare == TRAIN else TRAIN
        assert other not in message
    assert re.search(r"^train: .*gradient buffers and optimizer state.*prepare_for_training\(\)",
                     r["train_error_before_refit"])
    assert "prepare_for_training()" in r["train_error_lp_inference"]
    assert r["offload_during_split_step"].startswith("offload_before_refit: a split train step is open")
    v = r["value_worker"]
    assert v["error"].startswith("get_values: ") and INFER in v["error"]
    assert v["values_equal"]


def test_next_step_after_prepare_equals_a_run_without_offload(results):
    r = results["lifecycle"]
    assert r["logprobs_equal"] and r["reference_equal"]
    plain, lifecycle = r["metrics"]
    assert plain == lifecycle
    w_plain, w_life = r["weights"]
    assert w_plain.keys() == w_life.keys()
    for k in w_plain:
        assert torch.equal(w_plain[k], w_life[k]), k


def test_dropping_the_grad_buffers_keeps_weights_and_optimizer_and_trains_the_same(results):
    """cluster.offload_train_state=grads on the worker: drop_grad_buffers frees the gradient
    buffers alone; inference and the refit export still run, training refuses (naming the
    gradient buffers and prepare_for_training), and after prepare_for_training the next step
    gives the parameters of a worker that never dropped anything, bit for bit."""
    r = results["lifecycle"]
    start = r["bytes_start"]
    assert r["grads_bytes_dropped"] == dict(start, grads=0)
    assert re.search(r"^train: the worker's gradient buffers are offloaded.*"
                     r"prepare_for_training\(\)", r["grads_train_error"]), r["grads_train_error"]
    assert r["grads_refit_equal"] and r["grads_logprobs_equal"]
    assert r["grads_bytes_training"] == start
    assert r["grads_metrics"] == r["metrics"][0]
    plain = r["weights"][0]
    for k in plain:
        assert torch.equal(plain[k], r["grads_weights"][k]), k
    assert r["grads_then_offload_bytes"] == dict(start, grads=0, optimizer=0)
    assert r["grads_then_offload_flags"] == (False, False)


def test_bf16_wraps_in_float16_module_and_converts(results):
    r = results["bf16"]
    assert r["is_float16_module"]
    assert r["dtypes"].pop("module.fp32_extra") == torch.float32 and r["extra_value_kept"]
    assert set(r["dtypes"].values()) == {torch.bfloat16}
    assert r["export_names"] and r["export_equal_bf16"]
    assert r["output_dtype"] == torch.float32  # Float16Module's fp32 output on the last stage
    # bf16 keeps 8 significant bits: a rounding moves a value by at most u = 2**-8 of it. The
    # residual stream is rounded at the embedding and in each layer, the logits once more, and
    # its errors reach the logits at their scale: (layers + 2) roundings of the largest logit.
    # Measured: 0.0019, 1.6 roundings (bound 0.0048; the fp32 logits' largest is 0.31).
    u = torch.finfo(torch.bfloat16).eps / 2
    assert 0 < r["logit_diff"] < (ARCH.num_layers + 2) * u * r["logit_max"]


class _RecordingEngine:
    """A rollout backend that records the colocation hooks (and refits by the hf channel)."""

    shares_policy_weights = False
    needs_refit = False

    def __init__(self, calls):
        self.calls = calls

    def refit(self, policy):
        policy.call("get_hf_weights")
        return {"refit/gbytes": 0.0}

    def prepare_for_refit(self):
        self.calls.append("engine.prepare_for_refit")

    def prepare_for_generation(self):
        self.calls.append("engine.prepare_for_generation")

    def offload(self):
        self.calls.append("engine.offload")


POLICY_MOVES = {"offload_before_refit", "offload_after_refit", "prepare_for_lp_inference",
                "prepare_for_training"}


@pytest.mark.parametrize("offload", ["true", "grads", "false", True, False])
def test_controller_calls_the_lifecycle_in_order(offload):
    """Colocated, the policy's offload lifecycle around the engine's hooks; with
    ``cluster.offload_train_state`` false (``offload=False``) only the engine's hooks: no policy
    call moves anything and the refit has no ``offload_*`` hand-over; with grads only the
    gradient buffers' drop before the refit (its ``refit/offload_train_s``) and their return
    before training."""
    from mcore_rl.controller.colocation import Colocation
    from mcore_rl.controller.trainer import RLTrainer
    from mcore_rl.distributed.worker_group import typed

    calls = []
    policy = SimpleNamespace(
        call=typed(lambda method, *a: calls.append(method) or [{"w": torch.zeros(2)}]),
        gather_rows=typed(lambda method, *a: calls.append(method)),
        train=lambda *a: calls.append("train"),
    )
    mode = str(offload).lower()
    for colocate in (True, False):
        calls.clear()
        cfg = SimpleNamespace(policy=SimpleNamespace(logprob_micro_batch_size=4, micro_batch_size=2))
        trainer = SimpleNamespace(cfg=cfg, policy=policy, colocation=Colocation(
            policy, _RecordingEngine(calls), colocate, offload_train_state=offload))
        RLTrainer.policy_logprobs(trainer, {})
        RLTrainer.train_policy(trainer, {}, LOSS)
        refit = RLTrainer.refit(trainer)
        RLTrainer.policy_logprobs(trainer, {})
        moves = {f"refit/{p}_s" for p in ("offload_train", "offload_weights")}
        parts = {f"refit/{p}_s" for p in ("wake_weights", "transfer", "wake_kv")}
        parts |= {"true": moves, "grads": {"refit/offload_train_s"},
                  "false": {"refit/release_cache_s"}}[mode]
        assert parts <= set(refit) if colocate else not parts & set(refit)
        assert not (moves - parts) & set(refit)
        if colocate:  # the hand-overs add up to the refit's seconds
            assert sum(refit[k] for k in parts) <= refit["refit/seconds"]
        expected = ["engine.offload", "prepare_for_lp_inference", "get_logprobs",
                    "prepare_for_training", "train",
                    "offload_before_refit", "engine.prepare_for_refit", "get_hf_weights",
                    "offload_after_refit", "engine.prepare_for_generation",
                    "engine.offload", "prepare_for_lp_inference", "get_logprobs"]
        if mode != "true":
            expected = [c for c in expected if c not in POLICY_MOVES
                        or (mode == "grads" and c == "prepare_for_training")]
        if mode != "true":  # grads: the buffers dropped; false: the cached blocks returned
            expected.insert(expected.index("engine.prepare_for_refit"),
                            {"grads": "drop_grad_buffers", "false": "release_cached_memory"}[mode])
        if not colocate:
            expected = ["get_logprobs", "train", "get_hf_weights", "get_logprobs"]
        assert calls == expected


def test_offloader_round_trips_an_empty_set():
    # an optimizer before its first step has no state: offload moves nothing, restore must
    # still accept it (cluster.colocate_generation from a fresh start)
    from mcore_rl.megatron.offload import StorageOffloader

    off = StorageOffloader()
    assert off.offload([]) == 0 and off.offloaded
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload([])
    assert off.restore() == 0 and not off.offloaded
    with pytest.raises(RuntimeError, match="nothing is offloaded"):
        off.restore()


# ------------------------------------------------ cluster.offload_train_state, two RL steps
COLOCATED = [
    "cluster.use_ray=false", "cluster.colocate_generation=true", "grpo.max_steps=2",
    "grpo.num_prompts_per_step=2", "grpo.num_generations=4", "grpo.val_every=0",
    "grpo.val_at_start=false", "sft.steps=0", "checkpoint.every=0", "checkpoint.save_final=false",
    "logging.progress=false", "logging.tensorboard=false", "data.synthetic.num_train=12",
    "data.synthetic.num_test=2", "model.arch.num_layers=2", "model.arch.hidden_size=32",
    "model.arch.ffn_hidden_size=64", "policy.micro_batch_size=4",
    "policy.logprob_micro_batch_size=8", "policy.optimizer.weight_decay=0.1",
]


@pytest.fixture
def chars_reward(tmp_path, monkeypatch):
    """A reward of the response's characters (``sum of ord % 5``): random weights get mixed
    rewards, so the steps' gradients and Adam state are not zero."""
    (tmp_path / "offload_rewards.py").write_text(
        "def chars(response, example):\n    return float(sum(map(ord, response)) % 5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward processes inherit sys.path
    return "offload_rewards:chars"


def _colocated_run(tmp_path, reward: str, backend: str, setting: str, workers: int):
    """Two colocated GRPO steps with ``cluster.offload_train_state=setting``: the metrics
    rows, the policy's weights after them, and every method the controller called on the
    policy's workers (the group's one way out, spied)."""
    from mcore_rl.config.loader import load_config
    from mcore_rl.controller.loops import build
    from mcore_rl.utils.logging import read_metrics

    out = tmp_path / f"{backend}_{setting}"
    cfg = load_config("grpo_synthetic", COLOCATED + [
        f"reward.name={reward}", f"generation.backend={backend}",
        f"cluster.num_workers={workers}",
        f"cluster.offload_train_state={setting}", f"run.output_dir={out}"])
    loop = build(cfg)
    calls, group = [], loop.trainer.policy.group
    send = group.call_each_async
    group.call_each_async = lambda method, *a, **k: calls.append(method) or send(method, *a, **k)
    try:
        loop.fit()
        loop.trainer.colocation.prepare_for_lp_inference()  # offloaded: the weights come back
        weights = loop.trainer.policy.call("get_hf_weights")[0]
    finally:
        loop.close()
    return read_metrics(out), weights, calls


@pytest.mark.parametrize("backend,workers", [
    ("hf", 1), pytest.param("megatron", 2, marks=pytest.mark.slow)])
def test_keeping_the_train_state_trains_as_offloading_it(tmp_path, capsys, chars_reward,
                                                        backend, workers):
    """cluster.offload_train_state=false and grads against true, colocated: the same rewards,
    losses and weights after two RL steps; false calls no policy method that moves state, and
    its refits have no ``offload_*`` hand-over; grads drops the gradient buffers alone (no
    ``offload_weights``). The log says which, first."""
    run = functools.partial(_colocated_run, tmp_path, chars_reward, backend, workers=workers)
    rows_off, weights_off, calls_off = run("true")
    assert "cluster.offload_train_state=true: the policy's training state (" in (
        capsys.readouterr().out)
    rows_keep, weights_keep, calls_keep = run("false")
    assert "cluster.offload_train_state=false: the policy's training state stays on the GPU (" in (
        capsys.readouterr().out)
    steps = [r for r in rows_off if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["train/grad_norm"] > 0 for r in steps)
    for key in ("train/reward_mean", "train/loss", "train/grad_norm"):
        assert [r[key] for r in steps] == [r[key] for r in rows_keep if "train/loss" in r], key
    assert weights_off.keys() == weights_keep.keys()
    for k in weights_off:
        assert torch.equal(weights_off[k], weights_keep[k]), k
    assert "offload_before_refit" in calls_off and "prepare_for_training" in calls_off
    assert not POLICY_MOVES & set(calls_keep)
    for row in rows_keep:
        assert "refit/transfer_s" in row and not {"refit/offload_train_s",
                                                  "refit/offload_weights_s"} & set(row)
    assert all("refit/offload_train_s" in r for r in steps)
    rows_grads, weights_grads, calls_grads = run("grads")
    assert "cluster.offload_train_state=grads: the policy's gradient buffers (" in (
        capsys.readouterr().out)
    for key in ("train/reward_mean", "train/loss", "train/grad_norm"):
        assert [r[key] for r in steps] == [r[key] for r in rows_grads if "train/loss" in r], key
    for k in weights_off:
        assert torch.equal(weights_off[k], weights_grads[k]), k
    assert "drop_grad_buffers" in calls_grads and "prepare_for_training" in calls_grads
    assert not {"offload_before_refit", "offload_after_refit", "prepare_for_lp_inference"} & set(
        calls_grads)
    assert all("refit/offload_train_s" in r and "refit/offload_weights_s" not in r
               for r in rows_grads if "train/loss" in r)


def test_colocation_refuses_an_unknown_offload_mode():
    from mcore_rl.controller.colocation import Colocation

    with pytest.raises(ValueError, match=r"offload_train_state must be one of \('true', "
                                         r"'grads', 'false'\).*got 'auto'"):
        Colocation(SimpleNamespace(), _RecordingEngine([]), True, offload_train_state="auto")


@pytest.mark.parametrize("mode", ["true", "grads", "false"])
def test_a_backend_that_discarded_its_weights_is_refit_instead_of_woken(mode):
    """Colocation.prepare_for_generation (a step without refit: after a checkpoint save, PPO's
    critic warm-up, the start-up canary) with a backend whose sleep discarded its weights
    (``needs_refit``: vLLM sleep_level=2) runs a whole refit, so the next generate finds the
    policy's weights; a backend that kept them is only woken."""
    from mcore_rl.controller.colocation import Colocation
    from mcore_rl.distributed.worker_group import typed

    calls = []
    policy = SimpleNamespace(call=typed(lambda method, *a: calls.append(method)
                                        or [{"w": torch.zeros(2)}]))
    engine = _RecordingEngine(calls)
    colocation = Colocation(policy, engine, True, offload_train_state=mode)
    colocation.prepare_for_generation()
    woken = {"true": ["offload_after_refit"], "grads": ["drop_grad_buffers"],
             "false": ["release_cached_memory"]}[mode]
    assert calls == woken + ["engine.prepare_for_refit", "engine.prepare_for_generation"]
    calls.clear()
    engine.needs_refit = True
    colocation.prepare_for_generation()
    refit = {"true": ["offload_before_refit", "engine.prepare_for_refit", "get_hf_weights",
                      "offload_after_refit", "engine.prepare_for_generation"],
             "grads": ["drop_grad_buffers", "engine.prepare_for_refit", "get_hf_weights",
                       "engine.prepare_for_generation"],
             "false": ["release_cached_memory", "engine.prepare_for_refit", "get_hf_weights",
                       "engine.prepare_for_generation"]}[mode]
    assert calls == refit
