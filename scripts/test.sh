#!/usr/bin/env bash
# Set up .venv (first run only) and run the test suite (pytest over tests/). Arguments go to pytest.
# With FP8MON_TEST_DATABASE_URL=postgresql+psycopg://user@host:port/db the storage tests also run on
# PostgreSQL (and the run fails loudly if it is unreachable).
# Exit status: pytest's, except that a run in which no test ran (none collected, all deselected or all
# skipped) is a failure (1), never a success or pytest's ambiguous 5.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# System packages (Debian names) the tests need, installed when missing: prometheus (promtool and the server,
# for the alert-rule tests and tests/integration/test_prometheus.py), prometheus-alertmanager (the server and
# amtool, for tests/integration/test_alertmanager.py) and chromium (the headless browser that tests/web drives
# through playwright; playwright never downloads one).
TEST_APT_PACKAGES=(prometheus prometheus-alertmanager chromium)
ensure_apt_packages ${TEST_APT_PACKAGES[@]+"${TEST_APT_PACKAGES[@]}"}

ensure_venv
cd "$FP8MON_ROOT"

# The whole suite (no arguments, as CI runs it) starts with the linter and the type check of the public API: seconds.
if [ "$#" -eq 0 ]; then
  log "ruff check"
  "$VENV/bin/ruff" check --quiet . || { log "FAILED: ruff check (run: .venv/bin/ruff check --fix .)"; exit 1; }
  log "mypy on the public API"
  "$FP8MON_ROOT/scripts/typecheck.sh" || { log "FAILED: scripts/typecheck.sh"; exit 1; }
fi
log "pytest with $("$VENV/bin/python" -V); PostgreSQL: ${FP8MON_TEST_DATABASE_URL:-off (set FP8MON_TEST_DATABASE_URL)}"

report="$(mktemp -d)"
trap 'rm -rf "$report"' EXIT
set +e
# The 15 slowest tests are listed at the end (no test may need more than 60 s). One worker per CPU, each taking whole files: a module's fixtures (a server, an interpreter child's checks) are set
# up once, not once per worker. The files go out in the order collected: tests/conftest.py puts the slowest first (xdist
# would order them by their number of tests). On a machine with an NVIDIA GPU, one process: the GPU tests time kernels
# and must not share the device. FP8MON_TEST_WORKERS (or -n in the arguments) overrides it; 0 runs in this process.
if [ -z "${FP8MON_TEST_WORKERS:-}" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FP8MON_TEST_WORKERS=0
fi
"$VENV/bin/python" -m pytest -n "${FP8MON_TEST_WORKERS:-auto}" --dist loadfile --no-loadscope-reorder --durations=15 \
  --junitxml="$report/junit.xml" "$@"
rc=$?
set -e

if [ "$rc" -eq 5 ]; then
  log "FAILED: pytest collected no tests"
  exit 1
fi
if [ "$rc" -eq 0 ]; then
  ran="$("$VENV/bin/python" - "$report/junit.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites))
PY
)" || { log "FAILED: cannot read the test report"; exit 1; }
  if [ "$ran" -eq 0 ]; then
    log "FAILED: no test ran (all deselected or skipped)"
    exit 1
  fi
fi
exit "$rc"
