#!/usr/bin/env python
"""The refit to vLLM engines on GPUs of their own (NCCL), measured and broken on purpose
(issue 27): one run of ``--config`` with ``generation.backend=vllm`` and the engines off the
policy's GPUs (``cluster.colocate_generation=false``), plain processes (``--ray``: Ray actors;
a TP engine's workers then come from vLLM's Ray executor in the run's placement group).

1. Refit speed: ``--refits`` refits after the start-up one (which makes the NCCL group), each
   timed by the controller (``refit/seconds``, ``refit/gbytes``): GB/s per refit.
2. Parity: rollouts of ``--prompts`` training prompts sampled by the engines, scored by the
   policy (``get_logprobs``): NeMo RL's ``token_mult_prob_error`` and the abs gap mean and max,
   before training, then after ``--steps`` RL steps (each ending with a refit).
3. A killed engine: engine 0's process gets SIGKILL; then a refit, in a thread, watched for
   ``--hang-after`` seconds: it must end (with an error naming the gone engines) instead of
   waiting in an NCCL broadcast for a dead member.

Prints one table; exits 1 when the refit after the kill hung or did not fail.

    python3 scripts/gpu/vllm_refit.py --config grpo_smollm2_arith --set model.hf_path=DIR
    TP 2 under Ray (3 GPUs): ... --ray --set generation.vllm.tensor_parallel_size=2
    SMOKE: python3 scripts/gpu/vllm_refit.py --config grpo_synthetic --set cluster.device=cpu
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.config.loader import load_config  # noqa: E402
from mcore_rl.controller.logprob_budget import mismatch_figures  # noqa: E402
from mcore_rl.controller.loops import build  # noqa: E402
from mcore_rl.controller.trainer import step_seed  # noqa: E402


def parity(trainer, prompts: int, salt: int) -> dict:
    """Mismatch figures of ``prompts`` training prompts, one sampled response each."""
    rollout = trainer.generation.generate(trainer._prompts(trainer.train_data, range(prompts)),
                                          seed=step_seed(trainer.cfg.run.seed, 0, salt=salt))
    rollout["prev_logprobs"] = trainer.policy_logprobs(rollout)
    figures = mismatch_figures(rollout)
    figures["tokens"] = float(rollout["token_mask"][:, 1:].sum())
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="grpo_smollm2_arith")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides")
    parser.add_argument("--refits", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--hang-after", type=float, default=120.0)
    parser.add_argument("--ray", action="store_true", help="engines as Ray actors (cluster.use_ray)")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="vllm_refit_")
    cfg = load_config(args.config, args.set + [
        "generation.backend=vllm", "cluster.colocate_generation=false", f"cluster.use_ray={str(args.ray).lower()}",
        f"grpo.max_steps={args.steps}", "grpo.val_every=0", "grpo.val_at_start=false",
        "checkpoint.save_final=false", "logging.progress=false", f"run.output_dir={out}"])
    loop = build(cfg)
    tr = loop.trainer
    rows, status = [], 0
    try:
        first = loop.refit()
        rows.append(("start-up refit (makes the NCCL group)", f"{first['refit/seconds']:.3f} s, "
                     f"{first['refit/gbytes']:.3f} GB"))
        times = []
        for _ in range(args.refits):
            r = loop.refit()
            times.append(r["refit/seconds"])
        gb = first["refit/gbytes"]
        med = statistics.median(times)
        rows.append((f"refit, median of {args.refits}", f"{med:.3f} s for {gb:.3f} GB: "
                     f"{gb / med:.2f} GB/s (min {min(times):.3f}, max {max(times):.3f} s)"))
        before = parity(tr, args.prompts, salt=1)
        rows.append(("parity before training", _fmt(before)))
        for _ in range(args.steps):
            m = loop.rl_step()
            tr.step += 1
            rows.append((f"RL step {tr.step}", f"{m['timing/step_s']:.2f} s, refit "
                         f"{m.get('refit/seconds', float('nan')):.3f} s, reward "
                         f"{m['train/reward_mean']:.3f}, "
                         f"token_mult_prob_error {m['train/token_mult_prob_error']:.4f}"))
        after = parity(tr, args.prompts, salt=2)
        rows.append((f"parity after {args.steps} RL steps and their refits", _fmt(after)))
        engines = tr.generation.engines
        pid = engines._pids()[0][1]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while 0 not in engines.gone_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        outcome = {}

        def refit():
            try:
                outcome["value"] = loop.refit()
            except BaseException as e:  # noqa: BLE001 (reported)
                outcome["error"] = f"{type(e).__name__}: {e}"

        start = time.perf_counter()
        thread = threading.Thread(target=refit, daemon=True)
        thread.start()
        thread.join(args.hang_after)
        took = time.perf_counter() - start
        if thread.is_alive():
            status = 1
            rows.append(("refit after engine 0 was killed", f"HUNG (still waiting after {took:.0f} s)"))
        elif "error" in outcome:
            rows.append(("refit after engine 0 was killed", f"failed in {took:.2f} s: "
                         f"{outcome['error'][:300].replace(chr(10), ' ')}"))
        else:
            status = 1
            rows.append(("refit after engine 0 was killed", f"returned in {took:.2f} s (engines left: "
                         f"{tr.generation.alive})"))
    finally:
        if status == 0:
            loop.close()
    print(f"\n{args.config} {' '.join(args.set)}, vLLM engines on GPUs of their own\n")
    print("| what | measured |\n| --- | --- |")
    for what, value in rows:
        print(f"| {what} | {value} |")
    sys.stdout.flush()
    if status:
        os._exit(status)  # a thread is stuck in a collective: do not wait for it
    return status


def _fmt(f: dict) -> str:
    return (f"token_mult_prob_error {f['train/token_mult_prob_error']:.4f}, abs gap mean "
            f"{f['train/logprob_mismatch_mean']:.4f} max {f['train/logprob_mismatch_max']:.3f} nats "
            f"over {f['tokens']:.0f} tokens")


if __name__ == "__main__":
    sys.exit(main())
