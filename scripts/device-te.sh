#!/usr/bin/env bash
# Real Transformer Engine 2.20.2 for the lent H200 (torch 2.11.0+cu130, Python 3.12, no network).
#
#   bash scripts/device-te.sh prepare      # here, on the CPU machine: stages .te-device/ (needs ../shared/device-te)
#   # then five device calls back to back (the machine stays warm ~30 s between calls), one per part N=0..4:
#   #   carry [".te-device/pN"], command: bash scripts/device-te.sh part N
#   # then the call that uses TE: carry [".te-device/w", ".whl", ...], command: bash scripts/gpu-tests.sh ...
#   # (scripts/gpu-tests.sh runs `bash scripts/device-te.sh install` itself when .te-device/w is there).
#
#   bash scripts/device-te.sh part N       # on the device: keep part N in /tmp/te (prints what /tmp/te holds)
#
# When the tracked tree plus a 60 MB part no longer fits one call's 64 MiB copy: `bash scripts/device-te.sh halves`
# here splits parts 0-3 into .te-device/pNa and pNb (30 MB each); then nine calls, carrying .te-device/pNa with
# `bash scripts/device-te.sh part Na`, .te-device/pNb with `part Nb` (each appends its half), and p4 as before.
#   bash scripts/device-te.sh install      # on the device: reassemble + install into /tmp/site (idempotent)
#
# After `install`, `export PYTHONPATH=/tmp/site:$PYTHONPATH` makes `import transformer_engine` work.
# A part call that finds a fresh machine (earlier parts missing from its listing) means: start again at part 0.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case ${1:-} in
  prepare)
    recipe=../shared/device-te
    [ -x "$recipe/fetch.sh" ] || { echo "device-te: $recipe/fetch.sh not found (the recipe lives in the shared folder beside the checkout)" >&2; exit 2; }
    grep -qx '/.te-device/' .git/info/exclude 2>/dev/null || echo '/.te-device/' >> .git/info/exclude
    bash "$recipe/fetch.sh"
    ;;
  halves)
    for n in 0 1 2 3; do
      mkdir -p ".te-device/p${n}a" ".te-device/p${n}b"
      head -c 30000000 ".te-device/p$n/core.part$n" >".te-device/p${n}a/h"
      tail -c +30000001 ".te-device/p$n/core.part$n" >".te-device/p${n}b/h"
      cat ".te-device/p${n}a/h" ".te-device/p${n}b/h" | cmp -s - ".te-device/p$n/core.part$n" || { echo "device-te: half $n differs" >&2; exit 1; }
    done
    echo "device-te: halves in .te-device/p{0..3}{a,b}"
    ;;
  part)
    n=${2:?part number 0..4, or 0a..3b for halves}
    mkdir -p /tmp/te
    if [[ $n == [0-3][ab] ]]; then
      cat ".te-device/p$n/h" >>"/tmp/te/core.part${n%?}"  # a, then b: the part, reassembled
      echo "device-te: /tmp/te holds: $(cd /tmp/te && ls -l | awk 'NR > 1 {print $NF "=" $5}' | tr '\n' ' ')"
      exit 0
    fi
    cp ".te-device/p$n"/* /tmp/te/
    echo "device-te: /tmp/te holds: $(cd /tmp/te && ls | tr '\n' ' ')"
    ;;
  install)
    if python3 -c 'import sys; sys.path.insert(0, "/tmp/site"); import transformer_engine' 2>/dev/null; then
      echo "device-te: Transformer Engine already in /tmp/site"
    else
      bash .te-device/w/install-on-device.sh
    fi
    ;;
  *)
    sed -n '2,14p' "$0" >&2; exit 2 ;;
esac
