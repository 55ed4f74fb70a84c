"""The project's own `kernels/` package must not look like Hugging Face's `kernels` to transformers."""

import subprocess
import sys


def test_transformers_does_not_mistake_our_kernels_package():
    code = "from transformers.utils import is_kernels_available; print(is_kernels_available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_demo_set_is_small():
    from decoder.models import DEMO_DIR

    total = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert total < 50 * 2**20, total
