#!/usr/bin/env bash
# Put the peers' own Python packages in .peers (no dependencies, nothing imported at install), for
# tests/test_loss_parity.py, which loads their loss functions beside this project's. ~3 s.
#     bash tools/peers/install.sh            # from anywhere; idempotent
set -euo pipefail
cd "$(dirname "$0")/../.."
pins="verl==0.9.1 areal==1.0.4 trl==1.16.0"
have=true
for pin in $pins; do
  [ -d ".peers/${pin%%==*}-${pin##*==}.dist-info" ] || have=false
done
if $have; then
  echo "[peers] .peers is ready ($pins)"
  exit 0
fi
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
rm -rf .peers
# pip's output only when it fails: the one line below is the whole report otherwise
if ! log=$("$python" -m pip install -q --disable-pip-version-check --no-deps --target .peers $pins 2>&1); then
  echo "$log" >&2
  exit 1
fi
echo "[peers] installed $pins in .peers"
