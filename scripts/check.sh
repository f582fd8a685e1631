#!/usr/bin/env bash
# Lint, format check and type check, as CI runs them (tools from the project's venv).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check hf_cfp tests scripts
.venv/bin/ruff format --check hf_cfp tests scripts
.venv/bin/mypy
