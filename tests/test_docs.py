"""The README and the guides of docs/ (issue 38): the README stays short, every relative link
resolves (file and Markdown anchor), every config key, config name, repository path, test and
``mcore-rl`` verb the pages name exists, and the MkDocs site (mkdocs.yml) builds in strict mode,
which a broken link fails. Seconds: no training, one or two ``mkdocs build`` processes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import mkdocs  # noqa: F401  (the test extra installs it: a missing one fails, never skips)
import material  # noqa: F401

from mcore_rl.cli import COMMANDS
from mcore_rl.config.schema import TrainConfig

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 200
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
# Pages whose config keys, paths and verbs are checked against the code: everything but the
# design notes (they name planned keys and past states on purpose) and the generated reference
# (it is generated from the schema: tests/test_packaging.py checks it).
CHECKED = [p for p in PAGES if p.name not in ("design.md", "config-reference.md")]
# mcore-rl verbs whose parsers cli.main adds beside COMMANDS' config-composing ones.
VERBS = {*COMMANDS, "export", "convert-gguf", "plot"}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def github_anchor(heading: str) -> str:
    """GitHub's (and, for these headings, MkDocs') anchor of a Markdown heading: lower case,
    punctuation but ``-`` and ``_`` dropped, each space a ``-``."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _without_code(text: str) -> str:
    """``text`` with fenced code blocks blanked (a ``# comment`` there is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _without_code(path.read_text()), re.M):
        slug = github_anchor(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    """Targets of ``[text](target)`` and ``![alt](target)`` outside code, not URLs."""
    text = re.sub(r"`[^`\n]*`", "", _without_code(path.read_text()))
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    targets += re.findall(r"^ {0,3}\[[^\]]+\]:\s*(\S+)", text, re.M)  # [name]: target
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_readme_is_at_most_200_lines():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve_to_files_and_anchors(page):
    broken = []
    for link in relative_links(page):
        file, _, anchor = link.partition("#")
        target = (page.parent / file).resolve() if file else page
        if not target.exists():
            broken.append(f"{link}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading with anchor #{anchor} in {_rel(target)}")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)


def test_anchor_rule_matches_github():
    assert github_anchor("The Llama-3.1-8B shape on four GPUs: GRPO with colocated vLLM TP=2 "
                         "engines, one-step off-policy, TP parity (4 x H200, 2026-11-27)") == (
        "the-llama-31-8b-shape-on-four-gpus-grpo-with-colocated-vllm-tp2-engines-one-step-off-"
        "policy-tp-parity-4-x-h200-2026-11-27")
    assert github_anchor("The `megatron` generation backend (one H200, 2026-11-21)") == (
        "the-megatron-generation-backend-one-h200-2026-11-21")
    assert github_anchor("model.arch") == "modelarch"


def _config_paths() -> tuple[set[str], set[str]]:
    """(every dotted leaf key of the schema, every section and top-level key)."""
    leaves, sections = set(), set()

    def walk(node, prefix):
        for key in node:
            child = node._get_node(key)
            if OmegaConf.is_dict(child):
                sections.add(prefix + key)
                walk(child, f"{prefix}{key}.")
            else:
                leaves.add(prefix + key)

    walk(OmegaConf.structured(TrainConfig), "")
    return leaves, sections


LEAVES, SECTIONS = _config_paths()
TOP = {key.split(".")[0] for key in LEAVES}
FILE_SUFFIXES = {"safetensors", "json", "jsonl", "py", "yaml", "pt", "md", "txt", "parquet",
                 "index", "sh", "sbatch", "gguf"}
# Wrong on purpose: the troubleshooting guide quotes the error a misspelled key gives.
MISSPELT = {"grpo.num_generation"}


def config_keys(text: str) -> set[str]:
    """Dotted names whose first part is a config section (``grpo.max_steps``,
    ``policy.megatron``), as written anywhere on a page, file names (``model.safetensors``) not."""
    found = set()
    for name in re.findall(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+)", text):
        parts = name.split(".")
        if parts[0] in TOP and parts[-1] not in FILE_SUFFIXES and not (set(parts) & FILE_SUFFIXES):
            found.add(name)
    return found


@pytest.mark.parametrize("page", CHECKED, ids=_rel)
def test_config_keys_named_exist(page):
    wrong = sorted(k for k in config_keys(page.read_text())
                   if k not in LEAVES and k not in SECTIONS and k not in MISSPELT
                   and not (k.endswith("_") and any(x.startswith(k) for x in LEAVES)))
    assert not wrong, f"{_rel(page)} names config keys the schema lacks: {wrong}"


def test_config_key_finder():
    text = "`grpo.max_steps=3` model.safetensors cfg.env.max_turns `policy.megatron` reward/kl"
    assert config_keys(text) == {"grpo.max_steps", "policy.megatron"}


@pytest.mark.parametrize("page", CHECKED, ids=_rel)
def test_config_names_paths_tests_and_verbs_named_exist(page):
    text = page.read_text()
    missing = [f"--config-name {n}" for n in re.findall(r"--config-name[ =]([a-z0-9_][\w-]*)", text)
               if not (REPO / "configs" / f"{n}.yaml").is_file()]
    for path in re.findall(
            r"(?<![\w/.-])((?:mcore_rl|configs|scripts|bench|docker|tests|docs)/[\w./-]*[\w/])", text):
        if not (REPO / path).exists() and not (page.parent / path).exists():
            missing.append(path)
    for file, test in re.findall(r"(tests/[\w/]+\.py)::(\w+)", text):
        if (REPO / file).is_file() and not re.search(rf"^def {test}\(", (REPO / file).read_text(), re.M):
            missing.append(f"{file}::{test}")
    code = "\n".join(re.findall(r"^```.*?^```", text, re.M | re.S) + re.findall(r"`[^`\n]+`", text))
    missing += [f"mcore-rl {v}" for v in re.findall(r"(?:^|`)\s*(?:\.venv/bin/)?mcore-rl ([a-z][a-z-]*)", code, re.M)
                if v not in VERBS]
    assert not missing, f"{_rel(page)} names what does not exist: {missing}"


def _mkdocs(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # not -q: mkdocs 1.6 does not count the warnings --quiet hides, and builds in strict mode
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(root / "mkdocs.yml"), "-d", str(site)],
                          capture_output=True, text=True, env=env, cwd=root)


def test_docs_site_builds_in_strict_mode(tmp_path):
    done = _mkdocs(REPO, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "quickstart" / "index.html").is_file()


def test_docs_site_build_fails_on_a_broken_link(tmp_path):
    shutil.copy(REPO / "mkdocs.yml", tmp_path)
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [the missing guide](no-such-guide.md).\n")
    done = _mkdocs(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-guide.md" in done.stdout + done.stderr
