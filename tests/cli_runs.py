"""Many runs of a command line in one child interpreter, each captured as if it were its own process.

A bad-input test is about what a run prints and its exit status, and every run started as its own
process pays the interpreter and torch start-up (a few seconds each on two loaded cores). `run_many`
starts one child for a whole set of runs: each run's stdout and stderr are captured at file descriptors
1 and 2 (print, logging, tqdm and warnings all land there, as they do in a process of its own), its
status is what `sys.exit(main(argv))` would give, an exception escaping `main` is printed as Python
prints it (a `Traceback` on stderr, status 1), and the warning registries are cleared before each run so
a warning shows in every run that raises it, as it would in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_DRIVER = r"""
import importlib, json, os, sys, tempfile, traceback, warnings

module, spec, results = sys.argv[1:4]
main = importlib.import_module(module).main
out = []
for argv in json.loads(open(spec).read()):
    for m in list(sys.modules.values()):  # a fresh process has shown no warning yet
        reg = getattr(m, "__warningregistry__", None)
        if isinstance(reg, dict):
            reg.clear()
    warnings._filters_mutated()
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    sys.stdout.flush(); sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(files[0].fileno(), 1); os.dup2(files[1].fileno(), 2)
    try:
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException:
            traceback.print_exc()
            rc = 1
        if rc is None:
            rc = 0
        elif not isinstance(rc, int):  # sys.exit("message"): printed, status 1
            print(rc, file=sys.stderr)
            rc = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        os.close(saved[0]); os.close(saved[1])
    text = []
    for f in files:
        f.seek(0)
        text.append(f.read().decode(errors="replace"))
        f.close()
    out.append({"returncode": rc, "stdout": text[0], "stderr": text[1]})
with open(results, "w") as f:
    json.dump(out, f)
"""


def run_many(module: str, runs: dict[str, list[str]], timeout: float = 600) -> dict[str, subprocess.CompletedProcess]:
    """`python -m module *argv` for every argv in `runs`, all in one child interpreter (OMP_NUM_THREADS=1);
    the same keys back, each with the run's returncode, stdout and stderr."""
    names = list(runs)
    with tempfile.TemporaryDirectory() as d:
        spec, results = Path(d) / "runs.json", Path(d) / "results.json"
        spec.write_text(json.dumps([runs[n] for n in names]))
        child = subprocess.run([sys.executable, "-c", _DRIVER, module, str(spec), str(results)], capture_output=True,
                               text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"},
                               stdin=subprocess.DEVNULL)
        assert child.returncode == 0 and results.exists(), (child.returncode, child.stderr[-3000:])
        got = json.loads(results.read_text())
    return {n: subprocess.CompletedProcess([sys.executable, "-m", module, *runs[n]], r["returncode"], r["stdout"],
                                           r["stderr"]) for n, r in zip(names, got, strict=True)}
