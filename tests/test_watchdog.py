"""The hang watchdog (``watchdog.*``, :mod:`mcore_rl.controller.watchdog`): the deadline rule
(floor, factor, history), the thread on stand-in worker groups (fires once, after the deadline,
never for a phase that ended), and a planted hang: a 2-worker CPU run whose policy rank 1
sleeps in ``get_logprobs`` far past a 3 s floor ends with exit code 4 long before the sleep
would, rank 1's stack dump names the sleeping function, and one stderr line names the phase
and the rank."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mcore_rl.config.schema import WatchdogConfig
from mcore_rl.controller import watchdog as W
from mcore_rl.controller.watchdog import EXIT_CODE, Watchdog, deadline_seconds


# ---------------------------------------------------------------- the deadline rule
def test_deadline_without_history_is_factor_times_floor():
    assert deadline_seconds([], floor=600, factor=3) == 1800
    assert deadline_seconds([], floor=2, factor=1) == 2


def test_deadline_is_the_floor_for_short_phases_and_factor_times_the_longest_above_it():
    assert deadline_seconds([1.0, 5.0, 2.0], floor=600, factor=3) == 600
    assert deadline_seconds([100.0, 250.0, 30.0], floor=600, factor=3) == 750
    assert deadline_seconds([0.5], floor=1, factor=4) == 2


def test_watchdog_keeps_the_last_history_durations_per_phase():
    dog = Watchdog(WatchdogConfig(floor_seconds=1, factor=2, history=2), "/nonexistent")
    assert dog.deadline("train") == 2  # factor x floor before any run
    for seconds in (5.0, 0.1, 0.2):  # the 5 s run falls out of the window of 2
        token = dog.begin("train")
        token.start -= seconds
        dog.end(token)
    assert dog.deadline("train") == pytest.approx(1.0)  # max(1, 2 x 0.2...)
    token = dog.begin("train")
    token.start -= 3.0
    dog.end(token)
    assert dog.deadline("train") == pytest.approx(6.0, abs=0.01)
    assert dog.deadline("refit") == 2  # phases are kept apart


def test_disabled_and_unwatched_phases_have_no_token():
    assert Watchdog(WatchdogConfig(enabled=False), "/x").begin("train") is None
    assert Watchdog(WatchdogConfig(), "/x").begin("step") is None


# ---------------------------------------------------------------- the thread
class _FakeGroup:
    """Stands in for a worker group: one rank with a call not answered."""

    name = "policy"

    def __init__(self):
        self.dumped, self.killed = [], False

    def pending_calls(self):
        return [(1, "get_logprobs", 9.0)]

    def dump_stacks(self, header):
        self.dumped.append(header)
        return []

    def kill(self):
        self.killed = True


def _dog(tmp_path, group, exits, floor=0.2):
    return Watchdog(WatchdogConfig(floor_seconds=floor, factor=1, history=3), str(tmp_path),
                    groups=lambda: [group], exit=exits.append)


def test_overrun_dumps_names_the_call_kills_and_exits_with_code_4(tmp_path, capsys):
    group, exits = _FakeGroup(), []
    dog = _dog(tmp_path, group, exits)
    dog.start()
    start = time.monotonic()
    token = dog.begin("logprobs")
    dog._thread.join(timeout=10)
    assert exits == [EXIT_CODE] == [4]
    assert 0.2 <= time.monotonic() - start < 5
    assert dog.fired.is_set() and group.killed and len(group.dumped) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    line = err[0]
    assert line.startswith("mcore-rl: error: hang watchdog: phase logprobs ran ")
    assert "policy rank 1 (get_logprobs, 9.0 s)" in line and "(exit code 4)" in line
    controller = (tmp_path / "hang" / "controller.txt").read_text()
    assert "in test_overrun_dumps_names_the_call_kills_and_exits_with_code_4" in controller
    dog.end(token)


def test_phases_that_end_in_time_never_fire(tmp_path):
    group, exits = _FakeGroup(), []
    dog = _dog(tmp_path, group, exits, floor=0.5)
    dog.start()
    for _ in range(3):
        with dog.phase("train"):
            time.sleep(0.05)
        tracked = dog.track("generation", _done_after(0.05))
        tracked.result()
    time.sleep(0.7)
    dog.close()
    assert exits == [] and not group.killed and not dog.fired.is_set()
    assert not (tmp_path / "hang").exists()


def _done_after(seconds):
    from concurrent.futures import Future

    f = Future()
    threading.Timer(seconds, lambda: f.set_result(None)).start()
    return f


# ---------------------------------------------------------------- a planted hang
PLANTED = textwrap.dedent('''
    """A CPU run whose policy rank 1 hangs in get_logprobs (60 s: bounded, so a broken watchdog
    cannot hang the test forever)."""
    import os
    import sys
    import time

    from mcore_rl.workers.policy import PolicyWorker


    def planted_hang():
        with open(os.environ["PLANTED_MARK"], "w") as f:
            f.write(str(time.time()))
        time.sleep(60)


    class SleepyPolicyWorker(PolicyWorker):
        def get_logprobs(self, *args, **kwargs):
            if self.rank == 1:
                planted_hang()
            return super().get_logprobs(*args, **kwargs)


    if __name__ == "__main__":
        import mcore_rl.workers.policy
        from mcore_rl.cli import main

        mcore_rl.workers.policy.PolicyWorker = SleepyPolicyWorker  # what the trainer builds
        sys.exit(main(sys.argv[1:]))
''')

TINY = [
    "cluster.use_ray=false", "cluster.num_workers=2",
    "grpo.num_prompts_per_step=2", "grpo.num_generations=2", "grpo.max_steps=2",
    "grpo.val_every=0", "grpo.val_at_start=false", "sft.steps=0",
    "logging.progress=false", "logging.tensorboard=false",
    "data.synthetic.num_train=8", "data.synthetic.num_test=2",
    "generation.logprob_canary_prompts=0", "checkpoint.save_final=false",
    "model.arch.num_layers=2", "model.arch.hidden_size=32", "model.arch.ffn_hidden_size=64",
    # 16 s on a phase's first run (factor x floor): room for a loaded CI machine's first phases
    "watchdog.floor_seconds=8", "watchdog.factor=2",
]


def test_planted_hang_ends_the_run_with_exit_code_4_and_the_ranks_stack(tmp_path):
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    mark, out = tmp_path / "sleeping", tmp_path / "run"
    env = dict(os.environ, PLANTED_MARK=str(mark))
    proc = subprocess.run([sys.executable, str(script), "train", *TINY, f"run.output_dir={out}"],
                          env=env, capture_output=True, text=True, timeout=150)
    ended = time.time()
    assert mark.exists(), proc.stderr[-3000:]  # the planted hang was reached
    assert proc.returncode == EXIT_CODE == 4, proc.stderr[-3000:]
    # Deadline 16 s (factor x floor: the phase's first run) + dumps: not the 60 s of the sleep.
    assert ended - float(mark.read_text()) < 40
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mcore-rl: error: hang watchdog")]
    assert len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert "phase logprobs" in line and "policy rank 1 (get_logprobs" in line, line
    assert "policy rank 0" not in line, line  # rank 0 answered
    assert f"{out / 'hang'}" in line and "(exit code 4)" in line
    dump = (out / "hang" / "policy_rank_1.txt").read_text()
    assert "phase logprobs" in dump and "in planted_hang" in dump and "in get_logprobs" in dump
    assert "in get_logprobs" not in (out / "hang" / "policy_rank_0.txt").read_text()
    assert "controller.txt" in os.listdir(out / "hang")
