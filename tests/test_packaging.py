"""The project's own `kernels/` package must not look like Hugging Face's `kernels` to transformers."""

import subprocess
import sys
from pathlib import Path


def test_transformers_does_not_mistake_our_kernels_package():
    code = "from transformers.utils import is_kernels_available; print(is_kernels_available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_demo_set_is_small():
    """The committed demo set: what a recipe builds locally and git ignores (the 30 MB corpus datastore of
    `make corpus-drafter`) is not part of it."""
    from decoder.models import DEMO_DIR

    files = [p for p in DEMO_DIR.rglob("*") if p.is_file()]
    root = Path(__file__).resolve().parent.parent
    if (root / ".git").exists():
        out = subprocess.run(["git", "-C", str(root), "check-ignore", "--stdin"], input="\n".join(map(str, files)),
                             capture_output=True, text=True, timeout=60)
        ignored = set(out.stdout.splitlines())
        files = [p for p in files if str(p) not in ignored]
    total = sum(p.stat().st_size for p in files)
    assert total < 50 * 2**20, total
