#!/usr/bin/env bash
# CPU host cost of the rings per layer call: HEAD (one Python path, whole-stage regions) against 23b508d (C path,
# narrowing) and 23b508d's Python fallback; order H C P P C H; each run its own control (A B B A inside).
set -u
# Needs: git worktree add /tmp/old23 23b508d (its C path builds with the system compiler on first import).
cd /tmp/hostcost
. /work/main/.venv/bin/activate
args=(bench layer --spec local --dispatch-ring --rounds 10 --steps 16 --gc manual --json)
run() { # name, pythonpath, native
  echo "== $(date -u +%T) $1"
  PYTHONPATH=$2 BUFREUSE_NATIVE=$3 python3 -m bufreuse "${args[@]}" > "$1-$(date +%s).json" 2>"$1.err" || echo "$1 failed"
}
for who in head c py py c head; do
  case $who in
    head) run head /work/main 0 ;;
    c) run c /tmp/old23 1 ;;
    py) run py /tmp/old23 0 ;;
  esac
done
echo "== $(date -u +%T) done"
