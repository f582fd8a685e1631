#!/usr/bin/env bash
# Lint, format check, type check and the documentation build, as CI runs them (tools from the project's venv).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check hf_cfp tests scripts docs/*.py
.venv/bin/ruff format --check hf_cfp tests scripts docs/*.py
.venv/bin/mypy
# The docs site in strict mode: a broken link, heading anchor or API reference fails (CONTRIBUTING.md, "The
# documentation"). Not --quiet: it would hide the warnings that strict mode counts. NO_MKDOCS_2_WARNING drops the
# theme's banner about its successor, printed on every build.
if [[ ! -x .venv/bin/mkdocs ]]; then
  echo "scripts/check.sh: .venv has no mkdocs; install the docs extra: bash scripts/setup.sh dev,docs (or pip install -e \".[docs]\")" >&2
  exit 1
fi
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
