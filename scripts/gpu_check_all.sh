#!/usr/bin/env bash
# Every GPU check in one command, for one NVIDIA GPU (written for an H200 with torch 2.11, transformers 5.17,
# triton 3.6 installed system-wide), in at most 8 minutes, into ONE JSON file.
#
#   bash scripts/gpu_check_all.sh [OUT_JSON]      # default: $OUT/gpu_checks.json when OUT is set, else
#                                                 # build/gpu_checks.json
#
# Set-up: a venv with --system-site-packages (the machine's own torch, transformers and triton) and this
# checkout installed into it editable with --no-deps --no-build-isolation (nothing is downloaded); if that
# install fails, the checks run from the checkout on PYTHONPATH instead. Then, one after another, each with
# its own `timeout` and all under one overall deadline:
#   graphs     scripts/gpu_check_graphs.py       lean forward and CUDA graphs on the demo, tokens equal to AR's
#   costmodel  scripts/gpu_check_costmodel.py    step model predicted against measured on a random 8B Llama
#   batch      specpilot bench --batch-sizes ... batched AR against batched SD on the demo's code prompts
#   w12        scripts/gpu_check_w12.py          the w12 Triton kernel against bf16 F.linear, with a tile sweep
# The JSON holds, per check: its command, exit code (124 = timed out), wall seconds, the JSON files it wrote
# (parsed) and the tail of what it printed (its figures); plus the machine, the versions and the git commit.
# Exit status: 0 when every check exited 0, 1 when any failed or timed out, 3 (one line on stderr, nothing
# else done) when there is no NVIDIA GPU, 2 on a set-up failure.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PYTHON="${PYTHON:-python3}"
DEADLINE_S="${GPU_CHECK_DEADLINE_S:-460}"  # set-up and checks; writing the JSON takes a few seconds more
START=$(date +%s)

if [[ $# -ge 1 ]]; then
    RESULT="$1"
elif [[ -n "${OUT:-}" ]]; then
    RESULT="$OUT/gpu_checks.json"
else
    RESULT="build/gpu_checks.json"
fi

# No GPU: one line and exit 3, before any set-up.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu_check_all: no NVIDIA GPU here (nvidia-smi missing or lists none); run this on the GPU machine" >&2
    exit 3
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/specpilot-gpu-checks.XXXXXX")" || exit 2
VENV="${GPU_CHECK_VENV:-$WORK/venv}"
mkdir -p "$(dirname "$RESULT")" || exit 2

elapsed() { echo $(( $(date +%s) - START )); }

# -- set-up ------------------------------------------------------------------------------------------------
SETUP_LOG="$WORK/setup.log"
INSTALL="editable"
if [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv --system-site-packages "$VENV" >>"$SETUP_LOG" 2>&1; then
    PY="$VENV/bin/python"
    # --no-build-isolation --no-index: the system's setuptools builds it and nothing is downloaded.
    if ! timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$SETUP_LOG" 2>&1; then
        INSTALL="pythonpath (pip install -e failed: see the setup log)"
    fi
else  # no ensurepip (python3-venv) here: the system interpreter, on the checkout
    PY="$(command -v "$PYTHON")"
    INSTALL="pythonpath (no venv: $PYTHON -m venv failed)"
fi
if [[ "$INSTALL" != editable ]]; then
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$SETUP_LOG" 2>&1; then
    echo "gpu_check_all: torch under $PY sees no CUDA device though nvidia-smi lists one; see $SETUP_LOG" >&2
    exit 3
fi
echo "set up in $(elapsed) s ($INSTALL); work files under $WORK"

# -- checks ------------------------------------------------------------------------------------------------
# run_check NAME CAP_S CMD...: runs CMD with OUT=$WORK/NAME under `timeout` (CAP_S, or what the deadline
# leaves), recording exit code and wall seconds in $WORK/NAME/meta; prints one line per check.
CHECKS=()
run_check() {
    local name="$1" cap="$2"
    shift 2
    local dir="$WORK/$name" left
    mkdir -p "$dir"
    left=$(( DEADLINE_S - $(elapsed) ))
    (( left < cap )) && cap=$left
    CHECKS+=("$name")
    printf '%s\n' "$@" >"$dir/argv"
    if (( cap < 10 )); then
        echo "skipped: the ${DEADLINE_S} s deadline is spent" >"$dir/stderr"
        printf 'rc=125\nwall_s=0\ncap_s=%s\n' "$cap" >"$dir/meta"
        echo "$name: skipped (deadline spent)"
        return
    fi
    local t0 ms rc
    t0=$(date +%s%N)
    OUT="$dir" timeout -k 10 "$cap" "$@" >"$dir/stdout" 2>"$dir/stderr" </dev/null
    rc=$?
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    printf 'rc=%s\nwall_s=%d.%03d\ncap_s=%s\n' "$rc" $((ms / 1000)) $((ms % 1000)) "$cap" >"$dir/meta"
    echo "$name: exit $rc in $((ms / 1000)) s (limit $cap s)"
}

run_check graphs 80 "$PY" scripts/gpu_check_graphs.py
run_check costmodel 100 "$PY" scripts/gpu_check_costmodel.py
if "$PY" -c "import workbench.cli" >/dev/null 2>&1; then
    BATCH_RUNNER="cli"
    run_check batch 120 "$PY" -m workbench.cli bench --deployment demo --device cuda --prompts code \
        --max-new-tokens 64 --batch-sizes 1,4,8,16 --repeats 1 --quiet --out "$WORK/batch/bench_batch.json"
else
    # The command line needs GitPython and sqlite-utils (the workspace commands); without them the same
    # function the bench calls runs directly, with the bench's defaults.
    BATCH_RUNNER="direct (workbench.cli not importable: $("$PY" -c 'import workbench.cli' 2>&1 | tail -n 1))"
    run_check batch 120 "$PY" -c '
import json, os, sys
from pathlib import Path
from decoder.lab.batch_bench import format_batch_table, run_batch_bench
from decoder.lab.bench import bench_deployment
target, drafter, prompt_dir = bench_deployment("demo")
rep = run_batch_bench(target, drafter, "code", 64, (1, 4, 8, 16), deployment="demo", prompt_dir=prompt_dir,
                      device="cuda", repeats=1, progress=False)
Path(os.environ["OUT"], "bench_batch.json").write_text(json.dumps(rep, indent=2))
print(format_batch_table(rep))
'
fi
run_check w12 170 "$PY" scripts/gpu_check_w12.py

# -- the one JSON file -------------------------------------------------------------------------------------
"$PY" - "$WORK" "$RESULT" "$INSTALL" "$BATCH_RUNNER" "$DEADLINE_S" "$(elapsed)" "${CHECKS[@]}" <<'EOF'
import json
import subprocess
import sys
from pathlib import Path

work, result, install, batch_runner, deadline, setup_and_checks_s, *names = sys.argv[1:]
work = Path(work)


def tail(path: Path, n: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-n:] if path.exists() else []


def versions() -> dict:
    out = {}
    for mod in ("torch", "transformers", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # a missing module is a finding, not a crash
            out[mod] = f"unavailable: {type(e).__name__}: {e}"
    return out


def sh(*argv: str) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


checks = {}
for name in names:
    d = work / name
    meta = dict(line.split("=", 1) for line in (d / "meta").read_text().split())
    files = {}
    for f in sorted(d.glob("*.json")):
        try:
            files[f.name] = json.loads(f.read_text())
        except ValueError as e:
            files[f.name] = {"unreadable": str(e)}
    rc = int(meta["rc"])
    checks[name] = {
        "ok": rc == 0,
        "exit_code": rc,
        "timed_out": rc in (124, 137),
        "wall_s": round(float(meta["wall_s"]), 2),
        "limit_s": int(meta["cap_s"]),
        "command": (d / "argv").read_text().splitlines(),
        "json": files,
        "stdout_tail": tail(d / "stdout", 80),
        "stderr_tail": tail(d / "stderr", 20),
    }
checks.get("batch", {})["runner"] = batch_runner
report = {
    "ok": all(c["ok"] for c in checks.values()),
    "gpu": sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
    "versions": versions(),
    "git_commit": sh("git", "rev-parse", "HEAD"),
    "install": install,
    "setup_log_tail": tail(work / "setup.log", 20),
    "deadline_s": int(deadline),
    "total_s": int(setup_and_checks_s),
    "checks": checks,
}
Path(result).write_text(json.dumps(report, indent=2) + "\n")
print(f"wrote {result}: " + ", ".join(f"{n} {'ok' if c['ok'] else 'FAILED'}" for n, c in checks.items()))
sys.exit(0 if report["ok"] else 1)
EOF
