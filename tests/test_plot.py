"""``mcore-rl plot``: a run's curves from ``metrics.jsonl``.

- Two runs overlaid: a PNG of the size its panel count fixes, carrying the metric names drawn
  and the run names; the SVG beside it; a panel no run has data for is left out.
- ``--metrics`` picks panels and logged metric names; ``--output`` and ``--format``.
- Bad input (no directory, no metrics.jsonl, a broken line, an unknown or absent metric, a bad
  output suffix) exits 2 with one line naming what and where.
- The reader keeps a redone step's last value and skips a last line still being written.

tests/test_e2e.py plots the runs of its resume test (a run from the suite) the same way.
"""

from __future__ import annotations

import json

import pytest
from PIL import Image

from mcore_rl.cli import main
from mcore_rl.utils.plotting import COLUMNS, DPI, PANEL_INCHES, read_run, smooth

ALL = ["train/reward_mean", "val/accuracy",
       "timing/generation_s", "timing/step_s", "timing/train_s", "timing/validation_s",
       "train/logprob_mismatch_max", "train/logprob_mismatch_mean",
       "train/response_length", "val/response_length"]


def png_size(panels: int) -> tuple:
    """The PNG's pixels for ``panels`` panels."""
    columns = min(COLUMNS, panels)
    rows = -(-panels // columns)
    return (round(PANEL_INCHES[0] * columns * DPI), round(PANEL_INCHES[1] * rows * DPI))


def write_run(path, steps=6, val_every=3, mismatch=True):
    """A run directory whose metrics.jsonl has the keys a GRPO run logs (step 0: validation)."""
    path.mkdir(parents=True)
    records = [{"step": 0, "val/accuracy": 0.5, "val/response_length": 3.0}]
    for step in range(1, steps + 1):
        r = {"step": step, "train/reward_mean": 0.4 + 0.05 * step, "train/response_length": 3.5,
             "train/kl": 0.001 * step, "timing/generation_s": 0.3, "timing/train_s": 0.6,
             "timing/step_s": 1.0}
        if mismatch:
            r.update({"train/logprob_mismatch_mean": 1e-6, "train/logprob_mismatch_max": 1e-5})
        if step % val_every == 0:
            r.update({"val/accuracy": 0.5 + 0.05 * step, "val/response_length": 3.2,
                      "timing/validation_s": 0.2})
        records.append(r)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def png_text(path):
    with Image.open(path) as image:
        return image.size, dict(image.text)


def test_two_runs_overlaid_in_png_and_svg(tmp_path, capsys):
    a = write_run(tmp_path / "runs" / "grpo_a")
    b = write_run(tmp_path / "runs" / "grpo_b", steps=4, mismatch=False)
    out = tmp_path / "img" / "curves"
    assert main(["plot", str(a), str(b), "--output", str(out)]) == 0
    size, text = png_text(out.with_suffix(".png"))
    assert size == png_size(5)  # reward, accuracy, timing, mismatch, length
    assert text["Metrics"].split(", ") == ALL
    assert text["Runs"] == "grpo_a, grpo_b"
    svg = out.with_suffix(".svg").read_text()
    assert svg.startswith("<?xml") and "metrics: " + ", ".join(ALL) in svg
    assert "<dc:date>" not in svg  # the same runs give the same file
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [f"curves of grpo_a, grpo_b (reward, accuracy, timing, mismatch, length) "
                       f"written to {out}.png, {out}.svg"]


def test_default_panels_without_data_are_left_out(tmp_path):
    run = write_run(tmp_path / "run", mismatch=False)
    assert main(["plot", str(run), "--format", "png"]) == 0  # default output: <run>/curves
    size, text = png_text(run / "curves.png")
    assert size == png_size(4)
    assert not any("mismatch" in name for name in text["Metrics"].split(", "))
    assert not (run / "curves.svg").exists()


def test_metrics_choice_and_output_suffix(tmp_path):
    run = write_run(tmp_path / "run")
    out = tmp_path / "acc.png"
    assert main(["plot", str(run), "--metrics", "accuracy,train/kl", "--output", str(out),
                 "--format", "png", "--smooth", "0.6"]) == 0
    size, text = png_text(out)
    assert size == png_size(2)
    assert text["Metrics"] == "val/accuracy, train/kl"


@pytest.mark.parametrize("case, expected", [
    ("missing", "{missing}: no such run directory"),
    ("empty", "{empty}: no metrics.jsonl (not a run directory, or a run with logging.jsonl=false)"),
    ("broken", "{broken}/metrics.jsonl line 2: not a metrics record"),
    ("unknown", "--metrics rewards: not a panel (reward, accuracy, timing, mismatch, length)"),
    ("absent", "--metrics train/entropy: no such metric in {run}/metrics.jsonl"),
    ("suffix", "--output {tmp}/curves.jpg: expected a .png or .svg file, or no suffix"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, case, expected):
    paths = dict(tmp=tmp_path, missing=tmp_path / "nope", empty=tmp_path / "empty",
                 broken=tmp_path / "broken", run=write_run(tmp_path / "run"))
    paths["empty"].mkdir()
    paths["broken"].mkdir()
    (paths["broken"] / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, oops\n{"step": 2}\n')
    args = {"missing": [str(paths["missing"])], "empty": [str(paths["empty"])],
            "broken": [str(paths["broken"])],
            "unknown": [str(paths["run"]), "--metrics", "reward,rewards"],
            "absent": [str(paths["run"]), "--metrics", "reward,train/entropy"],
            "suffix": [str(paths["run"]), "--output", str(tmp_path / "curves.jpg")]}[case]
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("mcore-rl plot: error: " + expected.format(**paths)), err
    assert not list(tmp_path.rglob("curves.*"))


def test_reader_keeps_a_redone_steps_last_value_and_skips_a_cut_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "train/loss": 1.0}\n{"step": 2, "train/loss": 2.0}\n'
        '{"step": 2, "train/loss": 3.0}\n{"step": 3, "train/lo')  # resumed at 1; still writing
    assert read_run(str(tmp_path)) == {"train/loss": ([1, 2], [1.0, 3.0])}


def test_smoothing_is_tensorboards():
    assert smooth([1.0, 5.0, 2.0], 0.0) == [1.0, 5.0, 2.0]
    assert smooth([2.0] * 4, 0.9) == pytest.approx([2.0] * 4)  # debiased: no pull toward 0
    assert smooth([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])
