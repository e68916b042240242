#!/usr/bin/env bash
# Ray for the GPU machines (they have none, and no network), on the CPU machine, in the
# repository root (carry.sh runs it last; alone: `bash scripts/gpu/ray_carry.sh`):
#   .carry8/   ray_part_aa: the first 40 MiB of Ray's cp312 wheel (79 MB; ray 2.60.0, the version
#              of the CPU tests' environment: docker/Dockerfile still pins 2.54.0)
#   .carry9/   ray_part_ab: the rest of the wheel; ray_deps.tar: the wheels of what Ray's core
#              install requires (scripts/gpu/ray-requirements.txt, 3.4 MB; checked here to meet
#              every requirement of Ray and of each other for Python 3.12 on Linux x86-64:
#              scripts/gpu/ray_wheels.py closed); ray.sha256: the sha256 of the wheel and of each
#              of those wheels
# One folder per device call (each < 58 MB with the tree), the two in either order;
# `bash scripts/gpu/session.sh ray` then puts the wheel together, checks ray.sha256 and installs
# Ray and those of its requirements the device lacks into /tmp/site. Ignored by git
# (.git/info/exclude: /.carry*/). The names are none of `*.whl`: the vllm stage installs every
# wheel of /tmp/parts.
set -euo pipefail
RAY_VERSION=2.60.0
WHEEL=ray-$RAY_VERSION-cp312-cp312-manylinux2014_x86_64.whl
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform any)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

mkdir "$tmp/w"
"${PIP[@]}" -d "$tmp/w" "ray==$RAY_VERSION" -r scripts/gpu/ray-requirements.txt
[ -f "$tmp/w/$WHEEL" ] || { echo "ray_carry: no $WHEEL" >&2; exit 1; }
python3 scripts/gpu/ray_wheels.py closed "$tmp/w"
(cd "$tmp/w" && sha256sum -- *.whl) > "$tmp/ray.sha256"
mv "$tmp/w/$WHEEL" "$tmp/"
tar -cf "$tmp/ray_deps.tar" -C "$tmp/w" .
rm -rf .carry8 .carry9
mkdir .carry8 .carry9
split -b 40M "$tmp/$WHEEL" "$tmp/ray_part_"
mv "$tmp/ray_part_aa" .carry8/
mv "$tmp/ray_part_ab" "$tmp/ray_deps.tar" "$tmp/ray.sha256" .carry9/
[ ! -e "$tmp/ray_part_ac" ] || { echo "ray_carry: the wheel needs a third part" >&2; exit 1; }

# the parts put together as the device does, against the recorded sha256
sums=$PWD/.carry9/ray.sha256
mkdir "$tmp/check" && cat .carry8/ray_part_* .carry9/ray_part_* > "$tmp/check/$WHEEL"
tar -xf .carry9/ray_deps.tar -C "$tmp/check"
(cd "$tmp/check" && sha256sum -c --quiet "$sums")
sha=$(sha256sum "$tmp/check/$WHEEL" | cut -d' ' -f1)
echo "ray_carry: the parts make $WHEEL, $(stat -c %s "$tmp/check/$WHEEL") bytes, sha256 $sha (as recorded)"
for f in .carry8/* .carry9/*; do echo "  $f $(stat -c %s "$f") bytes"; done
du -sb .carry8 .carry9
