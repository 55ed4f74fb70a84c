"""The demo corpus: the Python standard library's source (code) and its bundled docs (prose).

Files are split into train / validation / held-out by a hash of their relative path, so the split
is stable across machines and runs. Held-out documents never reach training; they become the
`code` and `prose` prompt sets.
"""

from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

# Directories of tests and generated tables: unrepresentative code that would dominate a tiny corpus.
_TEST_PARTS = {"test", "tests", "idle_test"}
_SKIP_PARTS = {"site-packages", "dist-packages", "__pycache__", "pydoc_data"}
_SKIP_PREFIXES = ("encodings/cp", "encodings/mac_", "encodings/iso8859_", "encodings/koi8_")


@dataclass(frozen=True)
class Document:
    id: str
    domain: str  # "code" | "prose"
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _bucket(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100


# Percent of documents held out for prompts and for validation, per domain. Prose is scarcer and
# its chunks are small, so a larger share is held out to get enough prompts.
HELDOUT_PCT = {"code": 4, "prose": 12}
VAL_PCT = {"code": 3, "prose": 4}


def split_of(key: str, domain: str = "code") -> str:
    """'heldout', 'val' or 'train', stable for a given document key."""
    b = _bucket(key)
    if b < HELDOUT_PCT[domain]:
        return "heldout"
    if b < HELDOUT_PCT[domain] + VAL_PCT[domain]:
        return "val"
    return "train"


def code_documents(root: Path | None = None, include_tests: bool = False) -> list[Document]:
    """Standard-library modules; with `include_tests`, also its test suites (more code, odder style),
    minus files of generated data (huge files or very long lines)."""
    root = root or stdlib_dir()
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = set(path.relative_to(root).parts)
        if _SKIP_PARTS & parts or rel.startswith(_SKIP_PREFIXES):
            continue
        is_test = bool(_TEST_PARTS & parts)
        if is_test and not include_tests:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200:
            continue
        if is_test and (len(text) > 200_000 or max(map(len, text.splitlines()), default=0) > 500):
            continue
        docs.append(Document(id=f"stdlib/{rel}", domain="code", text=text))
    return docs


def prose_documents(chunk_chars: int = 3000) -> list[Document]:
    """The library reference text bundled with CPython, cut at paragraph boundaries into ~3 kB chunks
    (a topic can be 40 kB; chunking gives the split enough units to hold some out)."""

    docs = []
    for name, text in sorted(topics.items()):
        chunk: list[str] = []
        size = 0
        index = 0
        for para in re.split(r"(?<=\n\n)", text):
            chunk.append(para)
            size += len(para)
            if size >= chunk_chars:
                docs.append(Document(id=f"pydoc/{name}#{index}", domain="prose", text="".join(chunk)))
                chunk, size, index = [], 0, index + 1
        if size >= 200:
            docs.append(Document(id=f"pydoc/{name}#{index}", domain="prose", text="".join(chunk)))
    return docs


def all_documents(include_tests: bool = False) -> list[Document]:
    return code_documents(include_tests=include_tests) + prose_documents()


def make_prompt(text: str, target_chars: int = 1000, start_fraction: float = 0.2) -> str:
    """A prompt cut from a document: starts at a line boundary about `start_fraction` in, ~target_chars long,
    ends at a line boundary so the continuation starts on a fresh line."""
    lines = text.splitlines(keepends=True)
    start = int(len(lines) * start_fraction)
    # Prefer starting at a top-level statement or paragraph so the prompt reads as a unit.
    for i in range(start, min(len(lines), start + 40)):
        s = lines[i]
        if s.startswith(("def ", "class ", "@")) or (s.strip() and i > 0 and not lines[i - 1].strip()):
            start = i
            break
    out = []
    size = 0
    for line in lines[start:]:
        out.append(line)
        size += len(line)
        if size >= target_chars:
            break
    return "".join(out)


def write_prompt_sets(out_dir: Path, per_set: int = 16) -> dict[str, Path]:
    """Write `code.jsonl` and `prose.jsonl` from held-out documents (never trained on)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for domain, docs in (("code", code_documents()), ("prose", prose_documents())):
        held = [d for d in docs if split_of(d.id, domain) == "heldout" and len(d.text) >= 1200]
        # Spread picks across the held-out set deterministically.
        held.sort(key=lambda d: hashlib.sha256(d.id.encode()).hexdigest())
        rows = []
        for d in held:
            prompt = make_prompt(d.text, target_chars=900 if domain == "code" else 700)
            if len(prompt) < 400:
                continue
            rows.append({"id": d.id, "text": prompt})
            if len(rows) == per_set:
                break
        path = out_dir / f"{domain}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[domain] = path
    return paths
