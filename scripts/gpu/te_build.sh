#!/usr/bin/env bash
# Transformer Engine 2.20.2 for the GPU machines (Python 3.12, torch 2.11.0+cu130, CUDA 13.0, no
# network), built on the CPU machine, and the folders that carry it (issue 34):
#
#   nice -n 19 bash scripts/gpu/te_build.sh          (in the repository root; MAX_JOBS=2 default)
#
# 1. A Python 3.12 virtual environment in .te-build/venv with the device's torch (2.11.0 from
#    PyPI: its CUDA 13.0 build, which pulls the cu13 runtime, cuBLAS, cuDNN and NCCL wheels with
#    their headers), nvcc 13.0.88 with the CUDA C++ headers (cuda-toolkit[nvcc,crt,cccl]: the
#    toolkit version torch pins), cuDNN frontend's headers and ninja. No GPU is needed: the
#    extension is C++ (torch's CppExtension) compiled against those headers; nvcc only reports
#    the CUDA version. About 5.5 GB, 2 minutes to download here.
# 2. The transformer-engine-torch 2.20.2 sdist (sha256 checked) built into a cp312 wheel,
#    .te-build/dist/transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl
#    (NVTE_PYTORCH_FORCE_BUILD: no guess at a prebuilt wheel on GitHub; NVTE_NO_LOCAL_VERSION:
#    the version stays 2.20.2, which TE's import checks against the core wheel's;
#    NVTE_BUILD_USE_NVIDIA_WHEELS: headers from every nvidia-* wheel, cuDNN's and NCCL's too).
#    The log is .te-build/build.log. A wheel already built is kept (delete it to rebuild).
#    Measured 2026-11-27 on the 2-core CPU machine shared with others (load 5 to 18), nice 19,
#    MAX_JOBS=2: 33 C++ files in 57 min (14 CPU-minutes); the wheel is 1.1 MB. It links only
#    torch's CPU libraries (libc10, libtorch_cpu, libtorch_python; TE's core library and torch's
#    CUDA ones resolve at import), and it imports there with torch 2.11.0+cu130 and the core
#    wheel (`import transformer_engine.pytorch` works on a CPU; TE's modules then refuse to build
#    without CUDA).
# 3. The carry: one tar, split into .carry-te<k>/te_part_<xx> (51 MB each: one folder per device
#    call, < 58 MB with the working tree; the last folder holds te.tar.sha256 too), of
#    te/: what TE needs beyond the GPU image: the core library transformer-engine-cu13 2.20.2
#      (276 MB binary wheel), the meta package transformer-engine 2.20.2 (its dist-info is what
#      TE's import checks), the built extension, and pydantic (the recipes' dataclasses; the
#      image has none) with pydantic-core, annotated-types, typing-inspection, at the versions of
#      vLLM's carry, and nvdlfw-inspect (TE's debug API). Not carried: nvidia-cudnn-frontend's
#      Python package (it pulls nvidia-cutlass-dsl and apache-tvm-ffi; only the sm100 grouped MLP
#      fusion imports it); einops, onnx, onnxscript (the image has them).
#    bridge/: megatron-bridge 0.6.2 alone (--no-deps: with TE it imports with the image's
#      packages and carry.sh's omegaconf, hydra-core and antlr4; scripts/gpu/bridge_parity.py).
#    `bash scripts/gpu/session.sh te` puts the parts together and installs te/ into /tmp/te_site
#    and bridge/ into /tmp/bridge_site, each on PYTHONPATH only for the stages that use it.
#    Made 2026-11-27 in 20 s: .carry-te1..5 of 53,477,376 bytes and .carry-te6 of 16,455,680
#    (the tar: 283.8 MB), six device calls.
#
# Python 3.12: $TE_PYTHON, else python3 or python3.12 on PATH if one is 3.12, else pyenv's.
# Where there is none, build on the device (python3 is 3.12 with torch 2.11.0+cu130 there, no
# network): carry .te-src/ (the sdist, from `te_build.sh env sdist` on a machine that has the
# environment) and run there, in the repository root,
#   TE_PYTHON=python3 MAX_JOBS=16 bash scripts/gpu/te_build.sh wheel parts
# (stage env is skipped for an interpreter that imports torch; the wheel stage uses no index;
# the parts stage needs the carried wheels' registry: run it here on the wheel brought back).
#
# Stages: `te_build.sh [env] [sdist] [wheel] [parts]` (default: all four in that order).
set -euo pipefail
TE_VERSION=2.20.2
TORCH_VERSION=2.11.0
CUDA_TOOLKIT_VERSION=13.0.2
BRIDGE_VERSION=0.6.2
SDIST_SHA256=4c40ced8a6261649e689076f198d4feaf02277b1ba18931a66eccdaceb33c43e
BUILD=.te-build
SDIST=${TE_SDIST:-.te-src/transformer_engine_torch-$TE_VERSION.tar.gz}
WHEEL=$BUILD/dist/transformer_engine_torch-$TE_VERSION-cp312-cp312-linux_x86_64.whl
# The wheels carried with the built one (cp312 x86-64); pydantic at the versions vLLM's carry
# has (scripts/gpu/vllm-requirements.txt: both install into /tmp/site; tests/test_packaging.py
# keeps them equal).
CARRY_WHEELS=("transformer-engine-cu13==$TE_VERSION" "transformer-engine==$TE_VERSION"
              pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
              typing-inspection==0.4.5 nvdlfw-inspect==0.2.2)
PIP_DOWNLOAD=(download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
              --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

find_python312() {
    local p
    for p in ${TE_PYTHON:-} python3 python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        [ -n "$p" ] && "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
            && { command -v "$p"; return; }
    done
    echo "te_build.sh: no Python 3.12 here (set TE_PYTHON, or build on the device: see the header)" >&2
    return 1
}

stage_sdist() {  # the sdist, by its published sha256 (pip reads its metadata: needs the env)
    local req
    [ -f "$SDIST" ] && echo "$SDIST_SHA256  $SDIST" | sha256sum -c --quiet && return
    req=$(mktemp)
    echo "transformer-engine-torch==$TE_VERSION --hash=sha256:$SDIST_SHA256" > "$req"
    NVTE_NO_LOCAL_VERSION=1 "${TE_PYTHON:-$BUILD/venv/bin/python}" -m pip download -q --no-deps \
        --no-binary transformer-engine-torch --no-build-isolation --require-hashes -r "$req" \
        -d "$(dirname "$SDIST")"
    rm -f "$req"
    echo "$SDIST_SHA256  $SDIST" | sha256sum -c --quiet
}

stage_env() {  # the build environment: the device's torch and CUDA 13.0 headers, nvcc, pybind11
    local py
    if [ -n "${TE_PYTHON:-}" ] && "$TE_PYTHON" -c "import torch" 2>/dev/null; then
        return  # an interpreter with torch already (the device): build with it
    fi
    py=$(find_python312)
    if [ ! -x "$BUILD/venv/bin/python" ]; then
        "$py" -m venv "$BUILD/venv"
    fi
    "$BUILD/venv/bin/python" -m pip install -q --upgrade "pip>=24" \
        "torch==$TORCH_VERSION" "cuda-toolkit[nvcc,crt,cccl]==$CUDA_TOOLKIT_VERSION" \
        "nvidia-cudnn-frontend==1.32.0" "ninja==1.13.0" "setuptools>=61,<82" "wheel==0.45.1" \
        packaging
}

stage_wheel() {  # the extension, MAX_JOBS compile jobs; log in $BUILD/build.log
    local py=${TE_PYTHON:-$BUILD/venv/bin/python} t0=$SECONDS
    if [ -f "$WHEEL" ]; then echo "kept $WHEEL (delete it to rebuild)"; return; fi
    "$py" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION') and torch.version.cuda.startswith('13'), torch.__version__"
    mkdir -p "$BUILD/dist"
    echo "building $WHEEL (MAX_JOBS=${MAX_JOBS:-2}; log: $BUILD/build.log)"
    NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 \
    NVTE_BUILD_USE_NVIDIA_WHEELS=${NVTE_BUILD_USE_NVIDIA_WHEELS:-1} \
    NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-2} \
        "$py" -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$BUILD/dist" "$SDIST" \
        > "$BUILD/build.log" 2>&1 || { tail -n 30 "$BUILD/build.log"; return 1; }
    [ -f "$WHEEL" ] || { echo "no $WHEEL: see $BUILD/build.log"; ls "$BUILD/dist"; return 1; }
    echo "built $WHEEL in $((SECONDS - t0)) s"
    # what the extension links against (libtorch, libc10, ...: the device's torch provides them)
    unzip -o -q "$WHEEL" 'transformer_engine/wheel_lib/*.so' -d "$BUILD/check"
    readelf -d "$BUILD"/check/transformer_engine/wheel_lib/*.so | grep NEEDED
}

stage_parts() {  # the tar of the carried wheels, split over .carry-te<k>/
    local tmp k=0 part py=${TE_PYTHON:-$BUILD/venv/bin/python}
    tmp=$(mktemp -d)
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" RETURN
    mkdir "$tmp/te" "$tmp/bridge"
    "$py" -m pip "${PIP_DOWNLOAD[@]}" -d "$tmp/te" "${CARRY_WHEELS[@]}"
    "$py" -m pip "${PIP_DOWNLOAD[@]}" -d "$tmp/bridge" "megatron-bridge==$BRIDGE_VERSION"
    cp "$WHEEL" "$tmp/te/"
    tar -cf "$tmp/te.tar" -C "$tmp" te bridge
    (cd "$tmp" && sha256sum te.tar > te.tar.sha256 && split -b 51M te.tar te_part_)
    rm -rf .carry-te[0-9]*
    for part in "$tmp"/te_part_*; do
        k=$((k + 1))
        mkdir ".carry-te$k" && mv "$part" ".carry-te$k/"
    done
    cp "$tmp/te.tar.sha256" ".carry-te$k/"
    tar -tvf "$tmp/te.tar"
    du -sh .carry-te[0-9]*
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(env sdist wheel parts)
for stage in "${stages[@]}"; do
    t0=$SECONDS
    "stage_$stage"
    echo "== te_build $stage: $((SECONDS - t0)) s"
done
