#!/usr/bin/env bash
# Wheels a bare CUDA machine needs for scripts/gpu_check.sh (Python 3.12, torch and transformers
# already there, no package registry): megatron-core and omegaconf for CPython 3.12, into wheels/
# (git-ignored; a few MB). Run it where PyPI is reachable, then carry wheels/ to the GPU machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-.venv/bin/python}
mkdir -p wheels
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d wheels \
  megatron-core==0.16.1 omegaconf==2.4.0
ls -l wheels
