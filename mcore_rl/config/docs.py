"""Generate the config reference page (``docs/config-reference.md``) from the structured configs.

Every dotted key of :class:`~mcore_rl.config.schema.TrainConfig` is listed with its type, its
default, its valid values (the choices or range the field declares, :mod:`mcore_rl.config.checks`)
and its meaning. The meaning is the comment block directly above the field in ``schema.py`` (or
the comment at the end of the field's line), and a section's introduction is its dataclass
docstring, so the page is written from the code and cannot drift from it. The
page ends with example override lines for common changes. Regenerate with::

    python -m mcore_rl.config.docs --output docs/config-reference.md

``tests/test_packaging.py`` fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import sys
import tokenize
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mcore_rl.config import schema
from mcore_rl.config.checks import describe
from mcore_rl.config.schema import TrainConfig

REGENERATE_COMMAND = "python -m mcore_rl.config.docs --output docs/config-reference.md"

# (what the change does, the config file it starts from, the override lines that make it).
# tests/test_packaging.py merges each group into the schema and checks the file exists in
# configs/, so a renamed key, a wrong type or a missing config here fails a test.
EXAMPLE_OVERRIDES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Tensor and pipeline parallelism: TP=4, PP=2 on 16 workers (data parallel size "
     "16 / (4 x 2) = 2)", "grpo_gsm8k",
     ("cluster.num_workers=16", "policy.megatron.tensor_model_parallel_size=4",
      "policy.megatron.pipeline_model_parallel_size=2")),
    ("Larger GRPO groups: 16 generations for each of 64 prompts per step", "grpo_gsm8k",
     ("grpo.num_generations=16", "grpo.num_prompts_per_step=64")),
    ("Learning rate 1e-6 with 10 warmup steps and cosine decay to 1e-7", "grpo_gsm8k",
     ("policy.optimizer.lr=1e-6", "policy.optimizer.lr_warmup_steps=10",
      "policy.optimizer.lr_decay_style=cosine", "policy.optimizer.min_lr=1e-7")),
    ("Checkpoint every 20 RL steps; resume from the run directory's newest checkpoint",
     "grpo_gsm8k", ("checkpoint.every=20", "checkpoint.resume=latest")),
    ("Log to Weights & Biases (after `pip install wandb` and `wandb login`)", "grpo_gsm8k",
     ("logging.wandb=true", "logging.wandb_project=gsm8k-grpo", "run.name=qwen2.5-1.5b-lr1e-6")),
    ("Resume with a lower learning rate from here on (the schedule keeps its progress)",
     "grpo_gsm8k", ("checkpoint.resume=latest", "policy.optimizer.lr=5e-7")),
    ("GSM8K with a Hugging Face model (its tokenizer and chat template) on the full data set",
     "grpo_gsm8k",
     ("model.hf_path=/models/Qwen2.5-1.5B-Instruct", "data.train_path=/data/gsm8k/train.jsonl",
      "data.test_path=/data/gsm8k/test.jsonl", "data.max_prompt_length=256",
      "generation.max_new_tokens=512", "data.max_total_length=768")),
    ("bf16 with the distributed optimizer", "grpo_gsm8k",
     ("policy.megatron.precision=bf16", "policy.megatron.ddp.use_distributed_optimizer=true")),
    ("The synthetic task on CPU without Ray (laptop)", "grpo_synthetic",
     ("cluster.device=cpu", "cluster.use_ray=false")),
    ("Join a running Ray cluster (scripts/slurm/ray_job.sbatch appends this for you)",
     "grpo_gsm8k", ("cluster.ray_address=auto",)),
    ("Train a reward model on preference pairs (JSONL: prompt, chosen, rejected), from the "
     "policy's pretrained model", "grpo_smollm2_arith",
     ("algorithm=rm", "rm.train_path=/data/pairs/train.jsonl", "rm.test_path=/data/pairs/test.jsonl",
      "reward_model.optimizer.lr=1e-5")),
    ("RL on a reward model's score (an exported algorithm=rm run), the verifier tracked beside it",
     "grpo_smollm2_arith",
     ("reward.name=model", "reward_model.hf_path=/models/rm", "reward.verifier=math")),
)


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One leaf config key: ``key`` dotted (``policy.optimizer.lr``), ``type`` as written in the
    page (``float``, ``str or null``), ``default`` as typed in an override, ``meaning`` from the
    schema's comment (empty when the field has none), ``valid`` the values the field declares
    as the page shows them (``one of `hf`, `megatron` ``, ``null or `> 1` ``; empty when it
    declares none)."""

    key: str
    type: str
    default: str
    meaning: str
    valid: str = ""


@dataclasses.dataclass(frozen=True)
class SectionDoc:
    """One config dataclass reached from the root: ``path`` dotted (empty for the root), its
    docstring and its leaf keys in declaration order."""

    path: str
    doc: str
    keys: tuple[KeyDoc, ...]


@functools.cache
def _source_notes(module: types.ModuleType) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """Comments of every dataclass field and docstrings of every class in ``module``.

    Returns ``({(class name, field name): comment text}, {class name: docstring})``. A field's
    comment is the block of whole-line comments directly above it (no blank line between),
    followed by the comment at the end of its own line(s); ``#`` markers are stripped and the
    lines are joined with spaces.
    """
    source = inspect.getsource(module)
    whole_line: dict[int, str] = {}
    trailing: dict[int, str] = {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            text = tok.string.lstrip("#").strip()
            if lines[row - 1][:col].strip():
                trailing[row] = text
            else:
                whole_line[row] = text
    comments: dict[tuple[str, str], str] = {}
    docstrings: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        docstrings[node.name] = ast.get_docstring(node) or ""
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above = []
            row = stmt.lineno - 1
            while row in whole_line:
                above.insert(0, whole_line[row])
                row -= 1
            ends = [trailing[r] for r in range(stmt.lineno, stmt.end_lineno + 1) if r in trailing]
            comments[(node.name, stmt.target.id)] = " ".join(above + ends)
    return comments, docstrings


def _type_text(hint: Any) -> str:
    """``Optional[X]`` -> ``"X or null"``; ``List[X]`` -> ``"list of X"``; other hints by
    name (``int``, ``str``)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return f"{_type_text(args[0])} or null"
    if typing.get_origin(hint) is list:
        return f"list of {_type_text(args[0])}"
    return getattr(hint, "__name__", str(hint))


def _default_text(value: Any) -> str:
    """A default as a user types it in an override: ``null``, ``true``, ``1e-06``, ``runs/x``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    return repr(value)


def iter_sections(cls: type = TrainConfig, path: str = "") -> Iterator[SectionDoc]:
    """Walk the config dataclass ``cls`` depth first, in declaration order.

    Yields one :class:`SectionDoc` per dataclass (``cls`` itself first, with ``path`` as its
    dotted prefix). Meanings come from ``schema.py`` comments (see :func:`_source_notes`); a
    field inherited from a base dataclass has the comment written in the base.

    Raises:
        TypeError: ``cls`` is not a dataclass of :mod:`mcore_rl.config.schema`.
    """
    if not dataclasses.is_dataclass(cls) or cls.__module__ != schema.__name__:
        raise TypeError(f"{cls!r} is not a config dataclass of {schema.__name__}")
    comments, docstrings = _source_notes(schema)
    hints = typing.get_type_hints(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        key = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append((hints[f.name], key))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        owner = next(c for c in cls.__mro__ if f.name in vars(c).get("__annotations__", {}))
        keys.append(KeyDoc(key, _type_text(hints[f.name]), _default_text(default),
                           comments.get((owner.__name__, f.name), ""),
                           describe(cls, f.name, quote=lambda text: f"`{text}`")))
    yield SectionDoc(path, docstrings.get(cls.__name__, ""), tuple(keys))
    for sub_cls, sub_path in nested:
        yield from iter_sections(sub_cls, sub_path)


def _cell(text: str) -> str:
    """Text made safe for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def render_reference() -> str:
    """The whole Markdown page (``docs/config-reference.md``), ending with a newline."""
    sections = list(iter_sections())
    out = [
        "# Config reference",
        "",
        f"<!-- Generated from mcore_rl/config/schema.py by `{REGENERATE_COMMAND}`;"
        " do not edit by hand. -->",
        "",
        sections[0].doc,
        "",
        "Every key below can be set in a YAML file of `configs/` or on the command line as "
        "`key=value` (Hydra override grammar), e.g. "
        "`mcore-rl train --config-name grpo_gsm8k grpo.num_generations=16`. "
        "Valid values are checked when the config is loaded, so a bad value fails before any "
        "work starts, naming its key. "
        "The defaults are those of the structured config; the file chosen with "
        "`--config-name` may set other values (`mcore-rl train --config-name NAME --cfg` "
        "prints the composed config). In YAML and overrides, `null` is Python's `None`.",
        "",
        "Sections: " + ", ".join(f"[`{s.path}`](#{s.path.replace('.', '')})"
                                 for s in sections[1:]) + ".",
        "",
    ]
    for section in sections[1:]:
        out += [f"## {section.path}", ""]
        if section.doc:
            out += [section.doc, ""]
        if section.keys:
            out += ["| Key | Type | Default | Valid | Meaning |", "| --- | --- | --- | --- | --- |"]
            out += [f"| `{k.key}` | {k.type} | `{_cell(k.default)}` | {k.valid} | "
                    f"{_cell(k.meaning)} |" for k in section.keys]
            out.append("")
    out += [
        "## Example overrides",
        "",
        "On Slurm the same overrides follow the script: "
        "`sbatch --nodes=2 scripts/slurm/ray_job.sbatch --config-name grpo_gsm8k KEY=VALUE ...`"
        " (see scripts/slurm/README.md).",
        "",
    ]
    for what, config_name, overrides in EXAMPLE_OVERRIDES:
        out += [f"{what}:", "", "```bash", f"mcore-rl train --config-name {config_name} \\",
                "    " + " \\\n    ".join(overrides), "```", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print the page, or write it to ``--output``; name on stderr the keys that
    have no comment in ``schema.py`` (their meaning cell is empty). Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mcore_rl.config.docs",
                                     description="Write the config reference page (Markdown).")
    parser.add_argument("--output", type=Path, default=None,
                        help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    page = render_reference()
    if args.output is None:
        sys.stdout.write(page)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(page, encoding="utf-8")
    undocumented = [k.key for section in iter_sections() for k in section.keys if not k.meaning]
    if undocumented:
        print(f"{len(undocumented)} config keys have no comment in mcore_rl/config/schema.py: "
              + ", ".join(undocumented), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
