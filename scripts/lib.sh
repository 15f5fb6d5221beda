# shellcheck shell=bash
# Sourced by scripts/*.sh: a Python >= 3.11 virtual environment in .venv with fp8mon installed (editable),
# created on the first run and reused (in well under a second) while pyproject.toml is unchanged.
#
# Environment knobs: FP8MON_PYTHON (interpreter to build the venv from), FP8MON_VENV (default ./.venv),
# FP8MON_EXTRAS (default monitor,agent,trainer,dev), FP8MON_TORCH_INDEX_URL (where torch comes from when no local
# wheel is configured; default the PyTorch CPU index, or PyPI's CUDA build when nvidia-smi is present),
# FP8MON_NO_SETUP=1 (use the venv at FP8MON_VENV as it is: no creation, no install; for the scripts' tests).

FP8MON_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FP8MON_VENV:-$FP8MON_ROOT/.venv}"
FP8MON_EXTRAS="${FP8MON_EXTRAS:-monitor,agent,trainer,dev}"
# The torch these scripts install (the CPU build of a fresh machine; pyproject.toml accepts a range).
TORCH_VERSION=2.13.0

log() { printf '[fp8mon] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Run a command as root: directly, through password-less sudo, or not at all (returns 1).
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo -n "$@"
  else return 1
  fi
}

# ensure_apt_packages PKG...: install the Debian/Ubuntu packages of the list that are missing.
# A no-op (no apt-get update) when all are present; fails with the list when they cannot be installed.
ensure_apt_packages() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing system packages: ${missing[*]} (no apt-get: install them by hand)"
  log "installing system packages: ${missing[*]}"
  if ! { as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null \
         && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null; }; then
    die "could not install ${missing[*]}: run as root or with password-less sudo, or install them by hand"
  fi
}

# The first of FP8MON_PYTHON, python3.11, python3, python3.12, python3.13 that is Python >= 3.11.
find_python() {
  local candidate
  for candidate in "${FP8MON_PYTHON:-}" python3.11 python3 python3.12 python3.13; do
    if [ -z "$candidate" ] || ! command -v "$candidate" >/dev/null 2>&1; then continue; fi
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

_install_stamp() {
  {
    cat "$FP8MON_ROOT/pyproject.toml"
    echo "extras=$FP8MON_EXTRAS torch=$TORCH_VERSION root=$FP8MON_ROOT"
    "$VENV/bin/python" -c 'import sys; print(sys.version)'
  } | sha256sum | cut -d' ' -f1
}

_venv_usable() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys, pip; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

_create_venv() {
  local python version
  python="$(find_python)" || die "Python >= 3.11 not found: install python3.11 (Debian: apt-get install python3.11 python3.11-venv)"
  log "creating $VENV with $python ($("$python" -V 2>&1))"
  rm -rf "$VENV"
  if ! "$python" -m venv "$VENV" >/dev/null 2>&1; then
    rm -rf "$VENV"
    # Debian and Ubuntu ship ensurepip separately, in pythonX.Y-venv.
    version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    ensure_apt_packages "python$version-venv"
    "$python" -m venv "$VENV" || die "cannot create a virtual environment with $python"
  fi
}

_install_torch() {
  local pip=("$VENV/bin/python" -m pip)
  if "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    return 0
  fi
  # A local wheelhouse (pip's find-links) first; its dependencies come with the install of fp8mon below.
  if "${pip[@]}" install -q --no-index --no-deps "torch==$TORCH_VERSION" >/dev/null 2>&1; then
    return 0
  fi
  if [ -n "${FP8MON_TORCH_INDEX_URL:-}" ]; then
    "${pip[@]}" install "torch==$TORCH_VERSION" --index-url "$FP8MON_TORCH_INDEX_URL"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" install "torch==$TORCH_VERSION"  # PyPI's Linux wheels are the CUDA build
  else
    "${pip[@]}" install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  fi
}

# ensure_venv: create .venv if needed and install fp8mon[$FP8MON_EXTRAS] into it unless already done.
ensure_venv() {
  local lock
  if [ -n "${FP8MON_NO_SETUP:-}" ]; then
    [ -x "$VENV/bin/python" ] || die "FP8MON_NO_SETUP is set but $VENV/bin/python does not exist"
    return 0
  fi
  if command -v flock >/dev/null 2>&1; then  # two scripts started at once install once
    lock="${TMPDIR:-/tmp}/fp8mon-venv-$(printf '%s' "$VENV" | sha256sum | cut -c1-16).lock"
    exec 9>"$lock"
    flock 9
    _ensure_venv_locked
    exec 9>&-  # released before the caller execs a long-running command
  else
    _ensure_venv_locked
  fi
}

_ensure_venv_locked() {
  local stamp
  _venv_usable || _create_venv
  stamp="$(_install_stamp)"
  if [ "$(cat "$VENV/.fp8mon-installed" 2>/dev/null)" = "$stamp" ] \
     && "$VENV/bin/python" -c "import sys, fp8mon.monitor as m; sys.exit(not m.__file__.startswith('$FP8MON_ROOT/'))" 2>/dev/null; then
    return 0
  fi
  log "installing fp8mon[$FP8MON_EXTRAS] (editable) into $VENV"
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
  if [ -n "${CI:-}" ]; then export PIP_PROGRESS_BAR=off; fi
  case ",$FP8MON_EXTRAS," in *,agent,*|*,trainer,*|*,all,*) _install_torch ;; esac
  "$VENV/bin/python" -m pip install -q -e "${FP8MON_ROOT}[${FP8MON_EXTRAS}]"
  case ",$FP8MON_EXTRAS," in *,agent,*|*,trainer,*|*,all,*)
    "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
      || die "torch in $VENV is not $TORCH_VERSION" ;;
  esac
  echo "$stamp" >"$VENV/.fp8mon-installed"
  log "ready: $VENV"
}
