"""Build llama.cpp and convert the demo models to GGUF, into a version-keyed cache outside the clone.

The only source is the `llama-cpp-python` sdist from the package index (`pip download --no-binary :all:
--no-deps`); its vendored llama.cpp is built with CMake (native CPU flags, static, no web UI, no
OpenSSL, no network at build time) and the three tools the workbench uses are copied to
`$SPECPILOT_DATA_DIR/engines/llama.cpp-<version>/bin/` (`$SPECPILOT_ENGINES_DIR` replaces
`$SPECPILOT_DATA_DIR/engines` when set). Every clone shares that folder; a second run
finds the binaries and does nothing. The demo target and drafter are converted with the vendored
`convert_hf_to_gguf.py` into `.../models/demo/{target,drafter}-{f32,bf16}.gguf`.

    python -m decoder.engines.llamacpp_build build      # make llama-cpp
    python -m decoder.engines.llamacpp_build convert    # the demo GGUFs (builds nothing)
    python -m decoder.engines.llamacpp_build all        # both

Progress goes to stderr. A failure prints one line naming the step and the log file, and exits 1; a
wrong argument exits 2. Nothing half-written is left where a reader would take it: binaries and GGUFs
are written beside their final name and renamed into place.

Our tokenizer's pre-tokenizer (ByteLevel with the GPT-2 split regex) hashes to nothing the converter
knows, so it refuses the model. The converter's supported way for a model it cannot identify is to
give it the pre-tokenizer type; we do that from outside (`_CONVERT_SHIM`: `get_vocab_base_pre` of the
converter's `TextModel` answers `gpt-2` for our model's tokenizer and defers to the original for any
other) instead of editing the vendored hash table, so the sdist stays byte for byte as downloaded.
The result is checked: the GGUF's `tokenizer.ggml.pre` is `gpt-2`, and a test compares llama.cpp's
tokens with ours on every demo bench prompt.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from decoder.contract import data_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BINARIES = ("llama-server", "llama-bench", "llama-tokenize")
DEMO_MODELS = ("target", "drafter")
GGUF_TYPES = ("f32", "bf16")

EXIT_FAILED = 1
EXIT_USAGE = 2

# CMake settings: native CPU code, static binaries (relocatable, no rpath into the build folder), only
# what the three tools need, and nothing that reaches the network (the prebuilt web UI is fetched from
# Hugging Face at build time unless LLAMA_USE_PREBUILT_UI is off; OpenSSL is for HTTPS model downloads).
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)


class BuildError(RuntimeError):
    """A step of the build or conversion failed; the message is one line naming the step and its log."""


def engines_root() -> Path:
    """Where built engines live: `$SPECPILOT_ENGINES_DIR`, else `$SPECPILOT_DATA_DIR/engines` (a build can
    then be shared beyond one user's data, e.g. by CI or by tests, which keep a private data dir)."""
    env = os.environ.get("SPECPILOT_ENGINES_DIR")
    return Path(env).expanduser() if env else data_dir() / "engines"


def engine_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The shared cache for one llama.cpp version: `<engines root>/llama.cpp-<version>`."""
    return engines_root() / f"llama.cpp-{version}"


def binary(name: str, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Path of one built tool (it may not exist yet)."""
    return engine_dir(version) / "bin" / name


def is_built(version: str = LLAMA_CPP_PYTHON_VERSION) -> bool:
    """Whether every tool the workbench uses is in the cache and executable."""
    return all(os.access(binary(name, version), os.X_OK) for name in BINARIES)


def gguf_path(model: str, outtype: str, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Path of a demo model's GGUF (`model` in DEMO_MODELS, `outtype` in GGUF_TYPES)."""
    return engine_dir(version) / "models" / "demo" / f"{model}-{outtype}.gguf"


def source_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The vendored llama.cpp of the unpacked sdist (converter and gguf-py live there)."""
    return engine_dir(version) / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def missing_build_message() -> str:
    """The one line a user meets when the engine is needed and not built."""
    return f"llama.cpp is not built (looked for {binary('llama-server')}); run `make llama-cpp` first"


def _progress(msg: str) -> None:
    print(f"llama.cpp: {msg}", file=sys.stderr, flush=True)


@contextmanager
def _locked(root: Path, what: str) -> Iterator[None]:
    """One process per step and cache at a time (two clones running `make llama-cpp` at once wait in turn)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{what}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(step: str, cmd: Sequence[str | os.PathLike], log: Path, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> None:
    """Run one step with its output appended to `log`; a failure raises one line naming both."""
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(str(c) for c in cmd)}\n")
        fh.flush()
        try:
            rc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL).returncode
        except FileNotFoundError as exc:
            raise BuildError(f"{step} failed: {exc.filename} not found (see {log})") from None
    if rc != 0:
        raise BuildError(f"{step} failed with exit status {rc} (see {log})")


def _fetch_source(root: Path, log: Path, version: str) -> Path:
    """Download and unpack the sdist (once); returns the vendored llama.cpp folder."""
    src = source_dir(version)
    with _locked(root, "source"):
        if not (src / "CMakeLists.txt").is_file():
            _download_and_unpack(root, log, version)
    if not (src / "CMakeLists.txt").is_file():
        raise BuildError(f"the sdist has no vendor/llama.cpp/CMakeLists.txt (looked in {src})")
    return src


def _download_and_unpack(root: Path, log: Path, version: str) -> None:
    dist = root / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    sdist = dist / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        _progress(f"downloading the llama-cpp-python {version} sdist with pip")
        fetched = dist / f"tmp-{os.getpid()}"  # an interrupted download never sits where the next run looks
        shutil.rmtree(fetched, ignore_errors=True)
        try:
            _run("pip download", [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                                  "-d", fetched, f"llama-cpp-python=={version}"], log)
            if not (fetched / sdist.name).is_file():
                raise BuildError(f"pip download left no {sdist.name} in {fetched} (see {log})")
            os.replace(fetched / sdist.name, sdist)
        finally:
            shutil.rmtree(fetched, ignore_errors=True)
    _progress(f"unpacking {sdist.name}")
    unpack = root / f"src.tmp-{os.getpid()}"
    shutil.rmtree(unpack, ignore_errors=True)
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(unpack, filter="data")
    except (tarfile.TarError, OSError) as exc:
        shutil.rmtree(unpack, ignore_errors=True)
        raise BuildError(f"unpacking {sdist} failed: {exc}") from None
    shutil.rmtree(root / "src", ignore_errors=True)
    os.replace(unpack, root / "src")


def build(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2) -> Path:
    """Build the tools into the cache unless they are there; returns the `bin` folder."""
    root = engine_dir(version)
    bindir = root / "bin"
    if is_built(version):
        _progress(f"already built in {bindir}")
        return bindir
    with _locked(root, "build"):
        if is_built(version):  # another clone finished it while we waited
            _progress(f"already built in {bindir}")
            return bindir
        log = root / "build.log"
        log.write_text(f"llama.cpp build {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        _progress(f"building into {root} (log: {log})")
        src = _fetch_source(root, log, version)
        build_dir = root / "build"
        t0 = time.monotonic()
        _progress("configuring with cmake")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []  # else CMake's default (Makefiles)
        _run("cmake configure", ["cmake", "-S", src, "-B", build_dir, *generator, *CMAKE_FLAGS], log)
        _progress(f"compiling {', '.join(BINARIES)} with {jobs} jobs (about 7 minutes on 2 free cores, "
                  f"18 on a loaded 2-core machine)")
        targets: list[str] = []
        for name in BINARIES:
            targets += ["--target", name]
        _run("cmake build", ["cmake", "--build", build_dir, "-j", str(jobs), *targets], log)
        staged = root / f"bin.tmp-{os.getpid()}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        for name in BINARIES:
            built = build_dir / "bin" / name
            if not built.is_file():
                shutil.rmtree(staged, ignore_errors=True)
                raise BuildError(f"cmake build made no {built} (see {log})")
            shutil.copy2(built, staged / name)
        shutil.rmtree(bindir, ignore_errors=True)
        os.replace(staged, bindir)
        _progress(f"built {', '.join(BINARIES)} in {time.monotonic() - t0:.0f} s into {bindir}")
    return bindir


# Runs the vendored converter with one change made from outside: for our demo tokenizer (whose BPE
# pre-tokenizer hash the converter does not list) `get_vocab_base_pre` answers llama.cpp's `gpt-2` type
# (ByteLevel + the GPT-2 split regex, which is what ours is); any other model goes to the original.
_CONVERT_SHIM = r"""
import json, os, sys
conv_dir = sys.argv[1]
sys.argv = [os.path.join(conv_dir, "convert_hf_to_gguf.py")] + sys.argv[2:]
sys.path.insert(0, conv_dir)
import convert_hf_to_gguf as conv  # puts the vendored gguf-py on the path itself
from conversion.base import TextModel

def ours_is_gpt2(model_dir):
    try:
        with open(os.path.join(model_dir, "tokenizer.json")) as fh:
            tok = json.load(fh)
    except (OSError, ValueError):
        return False
    pre = tok.get("pre_tokenizer") or {}
    return (tok.get("model", {}).get("type") == "BPE" and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) and not pre.get("add_prefix_space", False))

_orig = TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    if ours_is_gpt2(self.dir_model):
        return "gpt-2"
    return _orig(self, tokenizer)

TextModel.get_vocab_base_pre = get_vocab_base_pre
conv.main()
outfile = sys.argv[sys.argv.index("--outfile") + 1]
pre = conv.gguf.GGUFReader(outfile).get_field("tokenizer.ggml.pre").contents()
if pre != "gpt-2":
    sys.exit(f"{outfile}: tokenizer.ggml.pre is {pre!r}, expected 'gpt-2'")
"""


def convert(models: Sequence[str] = DEMO_MODELS, outtypes: Sequence[str] = GGUF_TYPES,
            version: str = LLAMA_CPP_PYTHON_VERSION) -> list[Path]:
    """Convert the demo models to GGUF with the vendored converter (each file once); returns their paths."""
    if importlib.util.find_spec("sentencepiece") is None:
        raise BuildError("the converter needs sentencepiece (it imports it even for a tokenizer.json model); "
                         "run `pip install -e '.[llamacpp]'` or `make llama-cpp`")
    root = engine_dir(version)
    root.mkdir(parents=True, exist_ok=True)
    assets = Path(__file__).resolve().parent.parent / "assets" / "demo"
    out: list[Path] = []
    with _locked(root, "convert"):
        log = root / "convert.log"
        src = _fetch_source(root, log, version)
        for model in models:
            for outtype in outtypes:
                dest = gguf_path(model, outtype, version)
                out.append(dest)
                if dest.is_file():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
                _progress(f"converting demo {model} to {outtype} GGUF")
                env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
                try:
                    _run(f"converting demo {model} to {outtype}",
                         [sys.executable, "-c", _CONVERT_SHIM, src, assets / model, "--outtype", outtype,
                          "--outfile", tmp], log, env=env)
                    os.replace(tmp, dest)
                finally:
                    tmp.unlink(missing_ok=True)
    _progress(f"GGUFs in {root / 'models' / 'demo'}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m decoder.engines.llamacpp_build",
                                description="Build llama.cpp and convert the demo models to GGUF.")
    p.add_argument("what", choices=["build", "convert", "all"])
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    args = p.parse_args(argv)
    try:
        if args.what in ("build", "all"):
            build(jobs=args.jobs)
        if args.what in ("convert", "all"):
            convert()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
