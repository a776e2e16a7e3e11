#!/usr/bin/env bash
# From a fresh clone to the running Space in one command: `bash run.sh [app.py arguments]`.
#
# Creates (or reuses) .venv, takes llama-cpp-python from the project's wheel recipe through the cache the recipe and
# CI share (building it when missing: CUDA where nvcc and a GPU are present, else CPU), installs the requirements and
# the package, checks the installed build against the wheel's manifest, then runs app.py with the environment as it
# is (DFLASH_TARGET_* / DFLASH_DRAFT_*, DFLASH_DEMO, DFLASH_DEMO_PAIR, GRADIO_SERVER_PORT, ...). A step whose result
# is already there is skipped (stamps in .venv/.dflash-run keyed by what the step installed), so a second run starts
# the app in seconds. Sourced (as .ci/run does), it only defines the steps.
#
#   DFLASH_WHEEL_CACHE    wheels and their build trees (default ~/.cache/dflash-space/wheels-dl, as CI)
#   DFLASH_WHEEL_VARIANT  cpu or cuda instead of the automatic choice
#   DFLASH_CUDA_ARCH      CUDA architectures for the CUDA wheel (default: those of the GPUs nvidia-smi lists)
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

DFLASH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WHEEL_CACHE="${DFLASH_WHEEL_CACHE:-$HOME/.cache/dflash-space/wheels-dl}"
LOG_DIR="$DFLASH_ROOT/.cache/run-logs"
STAMPS="$DFLASH_ROOT/.venv/.dflash-run"
# Lines of requirements.txt that say where llama-cpp-python comes from (a published wheel's URL, the source build,
# the local dist folders) and the CUDA runtime it needs: the wheel taken from the cache replaces them.
WHEEL_LINES='^[[:space:]]*(llama[-_.]cpp[-_.]python|nvidia[-_.]cuda[-_.]runtime|nvidia[-_.]cublas)([^A-Za-z0-9._-]|$)'
WHEEL_LINES+='|^[[:space:]]*--find-links'

say() { printf '[run.sh] %s\n' "$*"; }

recipe() {  # recipe PYTHON_CODE [ARGS...]: code run with prebuilt_wheels/ importable (build_wheel, publish_wheel)
  PYTHONPATH="$DFLASH_ROOT/prebuilt_wheels${PYTHONPATH:+:$PYTHONPATH}" python -c "$@"
}

fail() {  # fail REASON [LOG]: the reason, the log's tail, and stop
  say "FAILED: $1"
  if [[ -n "${2:-}" && -s "$2" ]]; then
    say "last lines of $2:"
    tail -n 60 "$2"
  fi
  exit 1
}

logged() {  # logged WHAT LOG COMMAND...: run it with its output in LOG; on failure stop with WHAT and the log's tail
  local what=$1 log=$2 status=0
  shift 2
  mkdir -p "$(dirname "$log")"
  "$@" >"$log" 2>&1 || status=$?
  ((status == 0)) || fail "$what (exit status $status)" "$log"
}

digest() {  # sha256 of the files given, together
  cat "$@" | sha256sum | cut -d' ' -f1
}

stamp_is() { [[ -f "$STAMPS/$1" && "$(cat "$STAMPS/$1")" == "$2" ]]; }

write_stamp() { mkdir -p "$STAMPS" && printf '%s\n' "$2" >"$STAMPS/$1"; }

ensure_venv() {  # .venv with Python >= 3.10 and a current pip, activated
  if [[ -e .venv/bin/python ]]; then
    .venv/bin/python -c 'import sys' 2>/dev/null ||
      fail ".venv exists but its python does not run (moved, or its Python removed): rm -rf .venv and run again"
    if stamp_is venv ready; then
      say "venv: reusing .venv ($(.venv/bin/python --version))"
    else  # made elsewhere, or its pip upgrade did not finish
      say "venv: completing .venv ($(.venv/bin/python --version)): upgrading pip"
      logged "upgrading pip in .venv" "$LOG_DIR/pip.log" .venv/bin/python -m pip install --upgrade pip
    fi
  else
    command -v python3 >/dev/null || fail "no python3 on PATH: install Python 3.10 or newer"
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
      fail "$(python3 --version) is too old: this project needs Python 3.10 or newer"
    say "venv: creating .venv with $(python3 --version) and upgrading pip"
    logged "creating .venv" "$LOG_DIR/venv.log" python3 -m venv .venv
    logged "upgrading pip in .venv" "$LOG_DIR/pip.log" .venv/bin/python -m pip install --upgrade pip
  fi
  write_stamp venv ready
  # shellcheck disable=SC1091
  . .venv/bin/activate
}

gpu_archs() {  # the CUDA architectures of the GPUs nvidia-smi lists: 12.0 -> 120a-real (NVFP4 needs it), 9.0 -> 90-real
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | sort -u |
    sed -e 's/^120$/120a/' -e 's/$/-real/' | paste -sd, - || true
}

choose_variant() {  # sets VARIANT (cpu or cuda) and says why
  local nvcc gpus why
  nvcc="$(recipe 'import build_wheel; print(build_wheel.find_nvcc(None) or "")')"
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  case "${DFLASH_WHEEL_VARIANT:-}" in
    cpu | cuda) VARIANT=$DFLASH_WHEEL_VARIANT why="DFLASH_WHEEL_VARIANT=$DFLASH_WHEEL_VARIANT" ;;
    "")
      if [[ -n "$nvcc" && "$gpus" -gt 0 ]]; then
        VARIANT=cuda why="nvcc at $nvcc, and nvidia-smi lists $gpus GPU(s)"
      elif [[ -n "$nvcc" ]]; then
        VARIANT=cpu why="nvcc at $nvcc, but nvidia-smi lists no GPU"
      elif [[ "$gpus" -gt 0 ]]; then
        VARIANT=cpu why="nvidia-smi lists $gpus GPU(s), but no nvcc to build the CUDA wheel (install CUDA >= 12.8)"
      else
        VARIANT=cpu why="no GPU and no nvcc"
      fi
      ;;
    *) fail "DFLASH_WHEEL_VARIANT must be cpu or cuda, got '$DFLASH_WHEEL_VARIANT'" ;;
  esac
  say "llama-cpp-python variant: $VARIANT ($why)"
}

ensure_wheel() {  # ensure_wheel VARIANT: the recipe's wheel in the cache (built when missing); sets WHEEL
  local variant=$1 args=() archs
  mkdir -p "$WHEEL_CACHE"
  if [[ $variant == cpu ]]; then
    args+=(--cpu)
  else
    archs="${DFLASH_CUDA_ARCH:-$(gpu_archs)}"
    [[ -z "$archs" ]] || args+=(--arch "$archs")
  fi
  args+=(--jobs "$(nproc)" --out-dir "$WHEEL_CACHE/$variant" --build-root "$WHEEL_CACHE/build")
  say "llama-cpp-python wheel: prebuilt_wheels/build_wheel.py ${args[*]}"
  say "  (skipped when the cache holds one of this configuration, else built: about 5 min for the CPU wheel on 2 cores,"
  say "  longer for CUDA; log $LOG_DIR/build-wheel.log)"
  logged "building the llama-cpp-python wheel" "$LOG_DIR/build-wheel.log" \
    python prebuilt_wheels/build_wheel.py "${args[@]}"
  say "  $(grep -E '^(up to date:|built )' "$LOG_DIR/build-wheel.log" | tail -n 1)"
  local read_name='import json, sys; print(json.load(open(sys.argv[1]))["wheel"]["filename"])'
  WHEEL="$WHEEL_CACHE/$variant/$(python -c "$read_name" "$WHEEL_CACHE/$variant/manifest.json")"
}

install_wheel() {  # that wheel in the venv, unless this very file is installed already
  local stamp
  stamp="$(digest "$WHEEL") $(basename "$WHEEL")"
  if stamp_is wheel "$stamp" && compgen -G "$VIRTUAL_ENV/lib/python*/site-packages/llama_cpp_python-*.dist-info" \
    >/dev/null; then
    say "llama-cpp-python: $(basename "$WHEEL") already installed, skipping"
    return
  fi
  say "llama-cpp-python: installing $WHEEL"
  # --force-reinstall --no-deps replaces another build of the same version in a reused venv; then its dependencies.
  logged "installing the wheel" "$LOG_DIR/wheel.log" pip install -q --force-reinstall --no-deps "$WHEEL"
  logged "installing the wheel's dependencies" "$LOG_DIR/wheel.log" pip install -q "$WHEEL"
  write_stamp wheel "$stamp"
}

install_requirements() {  # install_requirements VARIANT [MORE_REQUIREMENT_FILES...]: requirements.txt less WHEEL_LINES
  local variant=$1 filtered="$STAMPS/requirements-$1.txt" stamp
  shift
  mkdir -p "$STAMPS"
  grep -viE "$WHEEL_LINES" requirements.txt >"$filtered" || true
  if [[ $variant == cuda ]]; then  # the CUDA runtime the wheel loads, as `build_wheel.py publish` pins it
    recipe 'from publish_wheel import CUDA_RUNTIME_REQUIREMENTS as r; print("\n".join(n + v for n, v in r.items()))' \
      >>"$filtered"
  fi
  stamp="$(digest "$filtered" "$@")"
  if stamp_is "requirements-$variant" "$stamp"; then
    say "requirements: requirements.txt${*:+ and $*} unchanged since the last install, skipping"
    return
  fi
  say "requirements: installing requirements.txt without its llama-cpp-python / CUDA runtime lines${*:+, and $*} (pip)"
  local files=(-r "$filtered") extra
  for extra in "$@"; do files+=(-r "$extra"); done
  logged "installing the requirements" "$LOG_DIR/requirements.log" pip install "${files[@]}"
  write_stamp "requirements-$variant" "$stamp"
}

install_package() {  # dflash_runtime, editable, from this checkout
  local stamp
  stamp="$(digest pyproject.toml) $DFLASH_ROOT"
  if stamp_is package "$stamp"; then
    say "package: dflash_runtime already installed from this checkout, skipping"
    return
  fi
  say "package: pip install -e . (dflash_runtime, editable)"
  logged "installing the package" "$LOG_DIR/package.log" pip install -e .
  write_stamp package "$stamp"
}

check_build() {  # check_build VARIANT: the installed llama-cpp-python is the wheel its manifest describes
  export DFLASH_WHEEL_MANIFEST="$WHEEL_CACHE/$1/manifest.json"  # and the app's own start-up check reads it
  say "build check: installed llama-cpp-python against $DFLASH_WHEEL_MANIFEST"
  logged "the installed llama-cpp-python is not the wheel of $DFLASH_WHEEL_MANIFEST (to reinstall: \
rm -rf .venv/.dflash-run, run again)" "$LOG_DIR/check.log" python -c '
import sys
from pathlib import Path
from dflash_runtime.space.setup.startup import check_manifests, installed_record_hashes, installed_version
check = check_manifests([Path(sys.argv[1])], installed_record_hashes(), installed_version())
print("\n".join(check.problems) or "installed build matches its wheel manifest")
sys.exit(0 if check.matches else 1)' "$DFLASH_WHEEL_MANIFEST"
  say "  $(tail -n 1 "$LOG_DIR/check.log")"
  # Recorded in the venv: the app started later from it (.venv/bin/python app.py) checks against the same manifest.
  write_stamp wheel-manifest "$DFLASH_WHEEL_MANIFEST"
}

main() {
  cd "$DFLASH_ROOT"
  ensure_venv
  choose_variant
  ensure_wheel "$VARIANT"
  install_wheel
  install_requirements "$VARIANT"
  install_package
  check_build "$VARIANT"
  say "starting the Space: python app.py $*"
  exec python app.py "$@"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
