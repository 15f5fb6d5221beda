#!/usr/bin/env bash
# Type-check fp8mon's public API with mypy: the package root, the CLI and the agent's facade, with the modules they
# import checked as far as they are used. The folders install as subpackages of fp8mon (pyproject.toml's package-dir),
# which mypy cannot follow from an editable install, so it reads them through a tree of links in that layout.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PUBLIC_API=(fp8mon/__init__.py fp8mon/cli.py fp8mon/agent/__init__.py fp8mon/agent/core.py)
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/fp8mon"
ln -s "$FP8MON_ROOT"/fp8mon/*.py "$tree/fp8mon/"
for part in agent monitor trainer migrations; do ln -s "$FP8MON_ROOT/$part" "$tree/fp8mon/$part"; done
cd "$tree"
"$VENV/bin/python" -m mypy --follow-imports=silent --ignore-missing-imports --no-error-summary \
  --cache-dir "${TMPDIR:-/tmp}/fp8mon-mypy-cache" "${PUBLIC_API[@]}"
