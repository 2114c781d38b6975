#!/usr/bin/env bash
# Assemble .mlm/ (gitignored): the three top-level files of a Megatron-LM release that `bufreuse-megatron` and
# examples/megatron-h200/run.sh need next to the megatron-core wheel (pretrain_gpt.py imports gpt_builders and
# model_provider; megatron.core and megatron.training come from the wheel). From a local git mirror of
# NVIDIA/Megatron-LM (the search tools' `fetch` puts one under /work/.mirror; any clone works), at the tag matching
# the installed megatron-core 0.19.x. Carry .mlm to the device with the run.
#   bash scripts/fetch-megatron-lm.sh [GIT_DIR] [REF]     # defaults: /work/.mirror/NVIDIA+Megatron-LM/repo core_v0.19.0
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
git_dir=${1:-/work/.mirror/NVIDIA+Megatron-LM/repo}
ref=${2:-core_v0.19.0}
files=(pretrain_gpt.py gpt_builders.py model_provider.py)
git --git-dir "$git_dir" rev-parse --verify -q "$ref^{commit}" >/dev/null \
  || { echo "fetch-megatron-lm: $git_dir has no $ref" >&2; exit 2; }
rm -rf .mlm.tmp && mkdir -p .mlm.tmp
git --git-dir "$git_dir" archive "$ref" "${files[@]}" | tar -x -C .mlm.tmp
git --git-dir "$git_dir" rev-parse "$ref^{commit}" >.mlm.tmp/MEGATRON_LM_COMMIT
rm -rf .mlm && mv .mlm.tmp .mlm
echo "fetch-megatron-lm: .mlm/ = Megatron-LM $ref ($(cat .mlm/MEGATRON_LM_COMMIT)): ${files[*]}"
