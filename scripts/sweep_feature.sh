#!/bin/bash
# Sweep the feature drafters' draft lengths on the demo (one process per setting; prints tau, speedup
# over ar-lean and drafting ms per step). Usage: scripts/sweep_feature.sh code|prose [LIMIT]
set -e
P=${1:-code}; L=${2:-8}
export OMP_NUM_THREADS=1
for k in 3 4 6 8 10 12; do
  .venv/bin/specpilot bench --deployment demo --prompts $P --max-new-tokens 128 --limit $L --quiet --json \
    --methods ar-lean,sd-draft-model-lean,sd-block,sd-mtp --block-draft-len $k --mtp-draft-len $(( k < 6 ? k : 6 )) \
  | .venv/bin/python -c "
import json,sys
r=json.load(sys.stdin)
print('k=$k', '  '.join(f\"{m['name']} tau {m['tau']:.2f} x{m['speedup_vs_ar']:.3f} draft {m.get('draft_ms_per_step') or 0:.2f}ms unexpl {m['unexplained_mismatches']}\" for m in r['methods'] if m['name'] != 'hf-greedy' and m['name'] != 'ar-lean'))"
done
