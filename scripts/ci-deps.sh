#!/usr/bin/env bash
# System packages the test suite uses beyond the Python venv, installed only when missing.
#
#   docker-compose   validates docker-compose.yml (tests/test_compose.py); Debian's package
#                    (Compose 1.29, no Docker engine needed for `config`).
#
# Safe to run repeatedly and as a non-root user: without root it only says what is missing,
# and the tests that need it skip with that reason.
set -euo pipefail

missing=()
if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
  missing+=(docker-compose)
fi

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "ci-deps: not root, not installing: ${missing[*]} (tests that need them will skip)" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-deps: no apt-get, not installing: ${missing[*]} (tests that need them will skip)" >&2
  exit 0
fi
echo "ci-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# No recommends: the Docker engine is not needed to validate compose files.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
