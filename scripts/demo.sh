#!/usr/bin/env bash
# Set up .venv (first run only) and run `fp8mon demo`: the monitor on a SQLite file in ./.fp8mon/ and a short
# real FP8 training with the agent attached, then serving until Ctrl-C. Arguments go to `fp8mon demo`
# (see ./scripts/demo.sh --help).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ensure_venv
cd "$FP8MON_ROOT"
exec "$VENV/bin/fp8mon" demo "$@"
