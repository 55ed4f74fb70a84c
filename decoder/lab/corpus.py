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


PROMPT_CHARS = {"code": 900, "prose": 700}
TIMING_PER_SET = 26  # with the demo's 6 hidden prompts, 32 = MIN_BATCH_UNITS x 8: one B = 8 pass times each once
TIMING_GAP_CHARS = 600  # a second prompt from a document starts this far past the end of its first


def _held_out(domain: str, docs: list[Document]) -> list[Document]:
    """The domain's held-out documents long enough for a prompt, in a fixed order spread across the set."""
    held = [d for d in docs if split_of(d.id, domain) == "heldout" and len(d.text) >= 1200]
    held.sort(key=lambda d: hashlib.sha256(d.id.encode()).hexdigest())
    return held


def _first_prompts(domain: str, held: list[Document], per_set: int) -> list[dict]:
    rows = []
    for d in held:
        prompt = make_prompt(d.text, target_chars=PROMPT_CHARS[domain])
        if len(prompt) >= 400:
            rows.append({"id": d.id, "text": prompt})
    return rows[:per_set] if per_set else rows


def write_prompt_sets(out_dir: Path, per_set: int = 16) -> dict[str, Path]:
    """Write `code.jsonl` and `prose.jsonl` from held-out documents (never trained on)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for domain, docs in (("code", code_documents()), ("prose", prose_documents())):
        rows = _first_prompts(domain, _held_out(domain, docs), per_set)
        path = out_dir / f"{domain}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[domain] = path
    return paths


def write_timing_sets(out_dir: Path, per_set: int = 16, count: int = TIMING_PER_SET) -> dict[str, Path]:
    """Write `code-timing.jsonl` and `prose-timing.jsonl`: `count` more held-out prompts per domain, none in the
    prompt sets of `write_prompt_sets(per_set)`, that a demo workspace adds to its hidden split so a timed pass
    under load (several batches) never repeats a prompt. First the held-out documents past the prompt sets',
    then second (third) prompts cut from every held-out document, TIMING_GAP_CHARS past the end of the one
    before (whose continuation never reappears as a prompt), ids `<document>@2` (`@3`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for domain, docs in (("code", code_documents()), ("prose", prose_documents())):
        held = _held_out(domain, docs)
        firsts = _first_prompts(domain, held, 0)
        rows = firsts[per_set:]
        starts = {d.id: 0 for d in held}
        for k in (1, 2, 3):  # the k-th prompt of each document, until there are `count`
            if k == 1:
                cuts = [(d, d.text) for d in held]
            else:
                cuts = []
                for d in held:
                    rest = d.text[starts[d.id] + TIMING_GAP_CHARS:]
                    rest = rest[rest.find("\n") + 1:] if "\n" in rest else ""  # from a line boundary
                    cuts.append((d, rest))
            for d, text in cuts:
                prompt = make_prompt(text, target_chars=PROMPT_CHARS[domain], start_fraction=0.2 if k == 1 else 0.0)
                at = d.text.find(prompt, starts[d.id]) if prompt else -1
                if at < 0:
                    starts[d.id] = len(d.text)
                    continue
                starts[d.id] = at + len(prompt)
                if k > 1 and len(prompt) >= 400 and len(d.text) - starts[d.id] >= 200:  # room for a continuation
                    rows.append({"id": f"{d.id}@{k}", "text": prompt})
        rows = rows[:count]
        path = out_dir / f"{domain}-timing.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[domain] = path
    return paths
