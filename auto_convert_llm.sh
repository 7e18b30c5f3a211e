#!/usr/bin/env bash
# One-click environment for MindSpeed: a virtual environment with the pinned packages for the
# chosen backend(s), import checks (numpy<2 with MindSpore), the example dataset, and the
# PYTHONPATH line to export. Safe to run again: finished steps are detected and skipped.
# Pins live in one place: mindspeed/versions.py (pip packages and the git commits of --fetch).
set -euo pipefail
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}   # Megatron-Core warns about optional Apex/TE at import

usage() {
  cat <<'USAGE'
usage: ./auto_convert_llm.sh [--backend torch|mindspore|both] [--venv DIR] [--python PY]
                             [--fetch] [--no-data] [--help]

  --backend B   what to prepare (default: both). torch: torch + Megatron-Core;
                mindspore: adds MindSpore (numpy<2 is checked; msrun must be present)
  --venv DIR    virtual environment to create or reuse (default: ./.venv)
  --python PY   interpreter that creates the venv (default: python3; Python 3.11)
  --fetch       also clone MSAdapter and Megatron-LM at the commits pinned in
                mindspeed/versions.py (GIT_PINS) into ./third_party, and install what
                Megatron-LM's megatron.training imports (setup.py extra "megatron-lm");
                a checkout is skipped with a message when offline or when no commit is pinned
  --no-data     do not prepare the example dataset (python -m mindspeed.data)
  --help        this text

Environment: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu adds PyTorch's CPU wheel index
(use it where plain PyPI would pull a CUDA build of torch).

Afterwards: source the printed `export PYTHONPATH=...` line, then e.g.
  bash tests_extend/example/train_distributed.sh       (torch, torchrun)
  bash tests_extend/example/train_distributed_ms.sh    (mindspore, msrun)
USAGE
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BACKEND=both
VENV="$ROOT/.venv"
PYTHON_BOOT=${PYTHON:-python3}
FETCH=0
DATA=1
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND=${2:?--backend needs a value}; shift 2 ;;
    --backend=*) BACKEND=${1#*=}; shift ;;
    --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
    --venv=*) VENV=${1#*=}; shift ;;
    --python) PYTHON_BOOT=${2:?--python needs an interpreter}; shift 2 ;;
    --fetch) FETCH=1; shift ;;
    --no-data) DATA=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$BACKEND" in torch|mindspore|both) ;; *) echo "error: --backend must be torch, mindspore or both (got '$BACKEND')" >&2; exit 2 ;; esac

step() { printf '\n==> %s\n' "$*"; }
ok() { printf '    ok: %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
# one line and exit 1 unless $1 is a Python that mindspeed/versions.py supports (an interpreter too old
# to parse versions.py gets the same kind of line)
check_python() {
  local why
  why=$("$1" "$ROOT/mindspeed/versions.py" --check-python 2>&1) && return 0
  why=$(printf '%s\n' "$why" | grep -m1 'is not supported') || why="$1 is not a supported Python: MindSpeed needs Python >=3.11,<3.12"
  die "$why"
}

# --- 1. virtual environment ----------------------------------------------------------------
step "virtual environment: $VENV"
if [ -x "$VENV/bin/python" ]; then
  check_python "$VENV/bin/python"
  ok "reusing it"
else
  command -v "$PYTHON_BOOT" >/dev/null || die "$PYTHON_BOOT not found (pass --python)"
  check_python "$PYTHON_BOOT"
  "$PYTHON_BOOT" -m venv "$VENV"
  ok "created"
fi
PY="$VENV/bin/python"

# --- 2. pinned packages (mindspeed/versions.py) ----------------------------------------------
# every choice keeps core: the MindSpore trainer's data tools and the adaptor use Megatron-Core
PIP_GROUPS="core test"
if [ "$BACKEND" != torch ]; then PIP_GROUPS="core mindspore test"; fi
if [ "$FETCH" = 1 ]; then PIP_GROUPS="$PIP_GROUPS megatron-lm"; fi   # what megatron.training imports
REQ_TEXT=$("$PY" "$ROOT/mindspeed/versions.py" $PIP_GROUPS) || die "cannot read mindspeed/versions.py"
mapfile -t REQS < <(printf '%s\n' "$REQ_TEXT" | sort -u)
step "packages: ${REQS[*]}"
missing=$("$PY" - "${REQS[@]}" <<'PYCHECK'
import sys
from importlib import metadata
def satisfied(req):
    for op in ("==", "<"):
        if op in req:
            name, ver = req.split(op)
            try:
                have = metadata.version(name)
            except metadata.PackageNotFoundError:
                return False
            if op == "==":
                return have.split("+")[0] == ver      # 2.13.0+cpu is torch==2.13.0
            return int(have.split(".")[0]) < int(ver)
    try:
        metadata.version(req)
        return True
    except metadata.PackageNotFoundError:
        return False
print(" ".join(r for r in sys.argv[1:] if not satisfied(r)))
PYCHECK
)
if [ -z "$missing" ]; then
  ok "all pinned versions already installed"
else
  echo "    installing: $missing"
  # TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) picks a CPU-only torch build where
  # the default index would pull a CUDA one; it is opt-in because an unreachable index costs
  # ~10 s of retries per package
  INDEX_ARGS=()
  [ -n "${TORCH_INDEX_URL:-}" ] && INDEX_ARGS=(--extra-index-url "$TORCH_INDEX_URL")
  "$PY" -m pip install -q "${INDEX_ARGS[@]}" $missing \
    || die "pip could not install: $missing (offline? install these pins by hand, then run again)"
  ok "installed"
fi

# --- 3. import checks ----------------------------------------------------------------------------
step "import checks"
"$PY" -c 'import numpy, torch, megatron.core; print("    torch", torch.__version__, "| megatron-core", megatron.core.__version__, "| numpy", numpy.__version__)' \
  || die "torch / Megatron-Core do not import in $VENV"
if [ "$BACKEND" != torch ]; then
  "$PY" -c 'import numpy; assert int(numpy.__version__.split(".")[0]) < 2, "numpy " + numpy.__version__ + " is 2.x: MindSpore 2.10 needs numpy<2"' \
    || die "numpy<2 does not hold; run: $PY -m pip install \"numpy<2\""
  GLOG_v=3 "$PY" -c 'import mindspore; print("    mindspore", mindspore.__version__)' \
    || die "MindSpore does not import; run: $PY -m pip install mindspore==2.10.0 \"numpy<2\""
  [ -x "$VENV/bin/msrun" ] || die "msrun is missing from $VENV/bin (reinstall mindspore)"
  ok "numpy<2 holds with MindSpore; msrun present"
fi
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'import mindspeed, mindspeed.support_matrix' \
  || die "the mindspeed package does not import from $ROOT"
ok "mindspeed imports from $ROOT"

# --- 4. example data -----------------------------------------------------------------------------
if [ "$DATA" = 1 ]; then
  step "example dataset (python -m mindspeed.data)"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m mindspeed.data \
    || die "could not prepare the example dataset (offline on first run? see python -m mindspeed.data --help)"
fi

# --- 5. optional source checkouts at pinned commits ------------------------------------------------
EXTRA_PATH=""
MEGATRON_DIR=""
if [ "$FETCH" = 1 ]; then
  step "source checkouts (GIT_PINS in mindspeed/versions.py)"
  while IFS='|' read -r name url commit; do
    dest="$ROOT/third_party/$name"
    if [ "$commit" = None ] || [ -z "$commit" ]; then
      echo "    skip $name: no commit pinned in mindspeed/versions.py (a branch would float; pin a 40-hex commit)"
      continue
    fi
    if [ -d "$dest/.git" ] && [ "$(git -C "$dest" rev-parse HEAD)" = "$commit" ]; then
      ok "$name already at $commit"
    elif ! timeout 20 git ls-remote "$url" >/dev/null 2>&1; then
      echo "    skip $name: $url is unreachable (offline?); run again with network access"
      continue
    else
      mkdir -p "$dest"
      git -C "$dest" init -q
      git -C "$dest" fetch -q --depth 1 "$url" "$commit" && git -C "$dest" checkout -q FETCH_HEAD \
        || die "could not fetch $name at $commit from $url"
      [ "$(git -C "$dest" rev-parse HEAD)" = "$commit" ] || die "$name is not at the pinned commit"
      ok "$name at $commit"
    fi
    [ "$name" = MSAdapter ] && [ -d "$dest/mindtorch" ] && EXTRA_PATH="$dest/mindtorch:"
    [ "$name" = Megatron-LM ] && MEGATRON_DIR="$dest"
  done < <("$PY" -c 'import runpy, sys; p = runpy.run_path(sys.argv[1])["GIT_PINS"]; [print(f"{k}|{u}|{c}") for k, (u, c) in p.items()]' "$ROOT/mindspeed/versions.py")
fi

# --- 6. what to export ----------------------------------------------------------------------------
step "ready"
echo "    source $VENV/bin/activate"
echo "    export PYTHONPATH=${EXTRA_PATH}$ROOT\${PYTHONPATH:+:\$PYTHONPATH}"
if [ -n "$MEGATRON_DIR" ]; then
  echo "    export MEGATRON_LM=$MEGATRON_DIR   # train_distributed.sh then runs its own pretrain_gpt.py"
  echo "    (add 'import mindspeed.megatron_adaptor' under 'import torch' in $MEGATRON_DIR/pretrain_gpt.py)"
fi
if [ -n "$EXTRA_PATH" ]; then
  echo "    (MSAdapter first on PYTHONPATH: 'import torch' is MindSpore underneath and MindSpeed picks the mindspore backend)"
fi
