"""Console progress (:class:`mcore_rl.utils.logging.Progress`, ``logging.progress``).

- On a terminal: a bar with the step, the phase running (told by the phase timer, the
  enclosing ``step`` not counted), the latest reward and held-out accuracy, and the time left;
  no lines.
- Elsewhere (a log file, a pipe): no bar (no carriage returns), one line per step with that
  step's figures, seconds per step and the time left; the validation before the first step is
  a line of its own; ``every`` thins the lines (the warm start's tenths); stages are named.
- Off: nothing at all.
"""

from __future__ import annotations

import io
import re
import sys

import pytest

from mcore_rl.utils.logging import Progress, RunLogger
from mcore_rl.utils.timers import PhaseTimer


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run_steps(logger: RunLogger, steps: int = 3) -> None:
    """What Loop.fit tells the logger: validation at step 0, then phased steps, validation
    at step 2."""
    timer = PhaseTimer()
    timer.listener = logger.phase
    logger.phase("validation")
    logger.log(0, {"val/accuracy": 0.52}, advance=False)
    for step in range(1, steps + 1):
        with timer.phase("step"):
            with timer.phase("generation"):
                pass
            with timer.phase("train"):
                pass
        metrics = {"train/reward_mean": 0.4 + step / 10, "train/loss": 0.01 * step,
                   "timing/step_s": 1.5}
        if step == 2:
            metrics["val/accuracy"] = 0.61
        logger.log(step, metrics)


def test_terminal_shows_a_bar_with_step_phase_reward_accuracy_and_time_left(
        monkeypatch, tmp_path, capsys):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logger = RunLogger(str(tmp_path), 4, tensorboard=False, jsonl=False, desc="ppo")
    run_steps(logger)
    logger.close()  # draws the last state (updates closer than tqdm's mininterval are not)
    frames = terminal.getvalue().split("\r")
    last = frames[-1]
    assert re.match(r"ppo: +75%\|.*\| 3/4 \[\d\d:\d\d<\d\d:\d\d, ", last), last
    assert last.rstrip().endswith("phase=train, reward=0.700, val_acc=0.610, loss=0.03]"), last
    assert any("phase=generation" in f for f in frames)
    assert any("phase=validation, val_acc=0.520" in f for f in frames)
    assert capsys.readouterr().out == ""  # no summary lines under a bar


def test_log_file_gets_one_line_per_step_and_no_bar(tmp_path, capsys):
    logger = RunLogger(str(tmp_path), 3, tensorboard=False, jsonl=False)
    assert logger.progress.mode == "lines"  # pytest's captured stderr is no terminal
    run_steps(logger)
    logger.close()
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err
    lines = captured.out.splitlines()
    assert lines[0] == "grpo step 0/3: val_acc 0.520"
    timing = r", \S+ s/step, \d\d:\d\d left"
    assert re.fullmatch(r"grpo step 1/3: reward 0\.500, loss 0\.01" + timing, lines[1]), lines[1]
    assert re.fullmatch(r"grpo step 2/3: reward 0\.600, val_acc 0\.610, loss 0\.02" + timing,
                        lines[2]), lines[2]
    assert re.fullmatch(r"grpo step 3/3: reward 0\.700, loss 0\.03, \S+ s/step, 00:00 left",
                        lines[3]), lines[3]
    assert len(lines) == 4


def test_off_prints_nothing(tmp_path, capsys):
    logger = RunLogger(str(tmp_path), 3, progress=False, tensorboard=False, jsonl=False)
    run_steps(logger)
    logger.close()
    assert capsys.readouterr() == ("", "")


def test_every_thins_the_lines_and_stages_are_named(capsys):
    sft = Progress("sft", 5, every=2)
    for i in range(5):
        sft.advance({"nll": f"{1.0 / (i + 1):.4f}"})
    stages = Progress("convert-gguf", 2, unit="stage")
    for name in ("read weights", "save"):
        stages.phase(name)
        stages.advance()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "sft step 2/5", "sft step 4/5", "sft step 5/5",
        "convert-gguf stage 1/2 (read weights)", "convert-gguf stage 2/2 (save)"]
    assert lines[0].startswith("sft step 2/5: nll 0.5000, ")
    assert lines[-1].endswith(" s/stage, 00:00 left")


def test_resumed_run_counts_from_its_step(capsys):
    progress = Progress("grpo", 10, initial=8)
    progress.advance({"reward": "0.500"})
    assert re.fullmatch(r"grpo step 9/10: reward 0\.500, \S+ s/step, \d\d:\d\d left",
                        capsys.readouterr().out.strip())


@pytest.mark.parametrize("nesting, shown", [
    (["step", "generation"], ["generation"]),
    (["step", "train_critic", "train"], ["train_critic", "train", "train_critic"]),
])
def test_phase_timer_tells_the_innermost_phase(nesting, shown):
    told = []
    timer = PhaseTimer()
    timer.listener = told.append

    def enter(names):
        if names:
            with timer.phase(names[0]):
                enter(names[1:])

    enter(nesting)
    assert told == shown
