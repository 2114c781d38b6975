#!/usr/bin/env bash
# Installs megatron-core into the active environment (written by the Megatron integration work).
set -euo pipefail
echo "install-megatron: not written yet"
