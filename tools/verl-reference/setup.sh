#!/usr/bin/env bash
# A virtual environment in which the reference's own reward file (Open-CLEANER's
# recipe/cleaner/reward.py) imports unchanged beside cleaner: its vendored verl on PYTHONPATH,
# the five packages its imports need, and a shim for transformers >= 5 (verl_tf5_compat.py).
#
#   tools/verl-reference/setup.sh OPEN_CLEANER_CHECKOUT [VENV]
#
# VENV (default .venv-verl) reuses this checkout's .venv (torch, transformers, cleaner) through a
# .pth file, so nothing large is downloaded but ray (~80 MB, which any verl import needs).
# Checked by hand (not in CI: it needs the network): CLEANER_REFERENCE=... pytest
# tests/engine/grading/test_reference_reward.py passes in it (docs/byo-task.md).
set -euo pipefail
REF=$(cd "${1:?usage: setup.sh OPEN_CLEANER_CHECKOUT [VENV]}" && pwd)
VENV=${2:-.venv-verl}
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=.venv/bin/python
[ -d "$REF/verl/verl" ] && [ -f "$REF/recipe/cleaner/reward.py" ] || { echo "$REF: not an Open-CLEANER checkout" >&2; exit 2; }
"$BASE" -m venv "$VENV"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$BASE" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/base_venv.pth"
# verl.protocol (any verl import) needs ray and tensordict, verl.utils.config omegaconf, reward.py
# datasets, verl.workers.config (core_algos.py, rollout_corr_helper.py) codetiming; its
# livecodebench runner imports anthropic's HUMAN_PROMPT, gone since anthropic 1.0
"$VENV/bin/python" -m pip install -q datasets ray tensordict omegaconf codetiming "anthropic<1"
cp "$HERE/verl_tf5_compat.py" "$SITE/" && echo "import verl_tf5_compat" > "$SITE/verl_tf5_compat.pth"
echo "$REF/verl" > "$SITE/open_cleaner_verl.pth"  # the reference's verl, as PYTHONPATH would give it
echo "ready: $VENV/bin/python -m cleaner collect --reward-fn $REF/recipe/cleaner/reward.py:compute_score_outcome_reward ..."
