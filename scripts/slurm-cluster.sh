#!/usr/bin/env bash
# One-node SLURM cluster on 127.0.0.1 for the slurm-marked tests (written by the SLURM launcher work).
set -euo pipefail
echo "slurm-cluster: not written yet"
