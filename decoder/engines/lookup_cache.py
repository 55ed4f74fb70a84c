"""llama.cpp's n-gram lookup caches, built from a deployment's own answers (mechanism `llama-ngram-corpus`).

llama-server's `--spec-type ngram-cache` drafts from three n-gram caches (llama.cpp's common/ngram-cache.cpp):
the request's own text (built as it decodes), a *dynamic* cache of 1- to 4-grams loaded with
`--lookup-cache-dynamic FILE` (drafts when an n-gram's top continuation is seen often enough: at least 4/3/2/2
times for n = 1/2/3/4 and at least 75/66/66/66% of its continuations) and a *static* cache of 2-grams,
`--lookup-cache-static FILE`, that weighs the other two's candidates (x100 for a continuation it has seen) and
drafts on its own as the last resort (2 samples, 50%). Upstream makes the files with `llama-lookup-create` on
a text corpus; here they are made from what the target itself answers (its greedy answers to self-instruct
prompts, `specpilot train smollm2-drafter --only data`), the corpus drafter's idea (`decoder/datastore.py`)
in the engine's own format, so the engine drafts with no forward of a model at all.

The file format (`common_ngram_cache_save`): for each n-gram, its LLAMA_NGRAM_MAX int32 tokens (-1 pads a
shorter one), an int32 count of distinct continuations, then that many (int32 token, int32 count) pairs;
little-endian, as llama.cpp writes it on the machines it runs on.

`draft` replays llama.cpp's drafting rule in Python (offline tau on recorded answers, and the tests' check that
the files say what was counted); ties between equal counts may break differently from the engine's hash map.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2  # LLAMA_NGRAM_MIN / _MAX / _STATIC
NULL = -1  # LLAMA_TOKEN_NULL
N_DRAFT = 8  # llama-server's ngram-cache drafts at most 8 tokens (create_state_ngram_cache)
# llama.cpp's thresholds per n-gram size (index n - 1): sample size and percent of the top continuation
LAX_SAMPLES, LAX_PERCENT = (2, 2, 1, 1), (66, 50, 50, 50)
STRICT_SAMPLES, STRICT_PERCENT = (4, 3, 2, 2), (75, 66, 66, 66)

Cache = dict[tuple[int, ...], dict[int, int]]  # n-gram (padded to NGRAM_MAX) -> continuation -> count


class LookupCacheError(ValueError):
    """A lookup cache file that cannot be read (truncated, or not in llama.cpp's format)."""


def _key(tokens: Sequence[int]) -> tuple[int, ...]:
    return tuple(tokens) + (NULL,) * (NGRAM_MAX - len(tokens))


def update(cache: Cache, tokens: Sequence[int], nmin: int, nmax: int, start: int = 0) -> None:
    """Count every n-gram (nmin <= n <= nmax) of `tokens` followed by a token at position >= `start`."""
    for n in range(nmin, nmax + 1):
        for i in range(max(start, n), len(tokens)):
            part = cache.setdefault(_key(tokens[i - n:i]), {})
            part[tokens[i]] = part.get(tokens[i], 0) + 1


def count(sequences: Iterable[Sequence[int]], nmin: int, nmax: int) -> Cache:
    cache: Cache = {}
    for seq in sequences:
        update(cache, list(seq), nmin, nmax)
    return cache


def prune_dynamic(cache: Cache) -> Cache:
    """Drop the n-grams the dynamic cache's thresholds never let draft (exactly as if they were absent)."""
    out: Cache = {}
    for k, part in cache.items():
        n = sum(1 for t in k if t != NULL)
        total, top = sum(part.values()), max(part.values())
        if total >= STRICT_SAMPLES[n - 1] and 100 * top >= STRICT_PERCENT[n - 1] * total:
            out[k] = part
    return out


def write(cache: Cache, path: Path) -> int:
    """Write `cache` in llama.cpp's format (atomically: a temporary file renamed); returns its bytes."""
    buf = bytearray()
    for k in sorted(cache):
        part = cache[k]
        buf += struct.pack(f"<{NGRAM_MAX}ii", *k, len(part))
        for tok in sorted(part):
            buf += struct.pack("<ii", tok, part[tok])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(bytes(buf))
    os.replace(tmp, path)
    return len(buf)


def read(path: Path) -> Cache:
    """Read a cache file written by llama.cpp or `write`."""
    data = Path(path).read_bytes()
    head = struct.calcsize(f"<{NGRAM_MAX}ii")
    cache: Cache = {}
    off = 0
    while off < len(data):
        if off + head > len(data):
            raise LookupCacheError(f"{path}: truncated n-gram record at byte {off}")
        *k, n = struct.unpack_from(f"<{NGRAM_MAX}ii", data, off)
        off += head
        if n <= 0 or off + 8 * n > len(data):
            raise LookupCacheError(f"{path}: bad continuation count {n} at byte {off - 4}")
        pairs = struct.unpack_from(f"<{2 * n}i", data, off)
        off += 8 * n
        cache[tuple(k)] = dict(zip(pairs[0::2], pairs[1::2], strict=True))
    return cache


def _try_static(static: Cache, key: tuple[int, ...]) -> int:
    part = static.get(key)
    if not part:
        return NULL
    tok, top = max(part.items(), key=lambda kv: kv[1])
    total = sum(part.values())
    if total < LAX_SAMPLES[NGRAM_STATIC - 1] or 100 * top < LAX_PERCENT[NGRAM_STATIC - 1] * total:
        return NULL
    return tok


def _try_primary(primary: Cache, keys: list[tuple[int, ...]], part_static: dict[int, int],
                 samples: tuple[int, ...], percent: tuple[int, ...]) -> int:
    for i in range(len(keys) - 1, -1, -1):  # the longest n-gram first
        part = primary.get(keys[i])
        if not part:
            continue
        best, best_p, best_s, total = NULL, 0, 0, 0
        for tok, c in part.items():
            s = 100 * part_static[tok] if tok in part_static else 1
            if c * s > best_p * best_s:
                best, best_p, best_s = tok, c, s
            total += c
        if total < samples[i] or 100 * best_p < percent[i] * total:
            continue
        return best
    return NULL


def draft(history: Sequence[int], context: Cache, dynamic: Cache, static: Cache, n_draft: int = N_DRAFT) -> list[int]:
    """The tokens llama.cpp's `common_ngram_cache_draft` drafts after `history` (prompt and output so far, the
    last token included), given the request's own n-gram cache `context` (of `history`)."""
    seq = list(history)
    out: list[int] = []
    if len(seq) < NGRAM_STATIC:
        return out
    while len(out) < n_draft:
        part_static = static.get(_key(seq[-NGRAM_STATIC:]), {})
        keys = [_key(seq[-n:]) for n in range(NGRAM_MIN, NGRAM_MAX + 1) if len(seq) >= n]
        tok = _try_primary(context, keys, part_static, LAX_SAMPLES, LAX_PERCENT)
        if tok == NULL:
            tok = _try_primary(dynamic, keys, part_static, STRICT_SAMPLES, STRICT_PERCENT)
        if tok == NULL:
            tok = _try_static(static, _key(seq[-NGRAM_STATIC:]))
        if tok == NULL:
            break
        out.append(tok)
        seq.append(tok)
    return out


def replay_tau(prompt: Sequence[int], answer: Sequence[int], dynamic: Cache, static: Cache,
               n_draft: int = N_DRAFT) -> tuple[int, int, int]:
    """Greedy verification of `answer` with llama.cpp's ngram-cache drafting: (tokens, verify steps, drafted)."""
    context: Cache = {}
    seq = list(prompt) + [answer[0]] if answer else list(prompt)
    update(context, seq, NGRAM_MIN, NGRAM_MAX)
    pos, steps, drafted = 1, 0, 0
    while pos < len(answer):
        d = draft(seq, context, dynamic, static, min(n_draft, 64))
        drafted += len(d)
        ok = 0
        while ok < len(d) and pos + ok < len(answer) and d[ok] == answer[pos + ok]:
            ok += 1
        new = list(answer[pos:pos + ok + 1])
        before = len(seq)
        seq += new
        update(context, seq, NGRAM_MIN, NGRAM_MAX, start=before)
        pos += len(new)
        steps += 1
    return len(answer) - 1, steps, drafted


def build(sequences: Iterable[Sequence[int]], out_dir: Path) -> dict:
    """Write `dynamic.bin` (1- to 4-grams, pruned to what can draft) and `static.bin` (2-grams) into `out_dir`
    from `sequences` of token ids (each an answer with its prompt's last tokens before it)."""
    seqs = [list(s) for s in sequences]
    dynamic = prune_dynamic(count(seqs, NGRAM_MIN, NGRAM_MAX))
    static = count(seqs, NGRAM_STATIC, NGRAM_STATIC)
    return {"sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
            "dynamic_ngrams": len(dynamic), "dynamic_bytes": write(dynamic, out_dir / "dynamic.bin"),
            "static_ngrams": len(static), "static_bytes": write(static, out_dir / "static.bin")}


def save_sequences(sequences: Iterable[Sequence[int]], path: Path, meta: dict | None = None) -> dict:
    """Commit-sized form of a corpus: the token ids (uint32, compressed) and their offsets, plus `meta`."""
    seqs = [np.asarray(list(q), dtype=np.uint32) for q in sequences]
    offsets = np.cumsum([0] + [len(q) for q in seqs]).astype(np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, tokens=np.concatenate(seqs) if seqs else np.zeros(0, np.uint32), offsets=offsets,
                        meta=np.frombuffer(json.dumps(meta or {}).encode(), dtype=np.uint8))
    os.replace(tmp, path)
    return {"sequences": len(seqs), "tokens": int(offsets[-1]), "bytes": path.stat().st_size}


def load_sequences(path: Path) -> tuple[list[list[int]], dict]:
    with np.load(path) as z:
        tokens, offsets = z["tokens"], z["offsets"]
        meta = json.loads(bytes(z["meta"]).decode()) if "meta" in z else {}
    return [tokens[a:b].astype(np.int64).tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)], meta


def materialise(asset: Path, dest: Path) -> Path:
    """The caches of a committed corpus `asset` (`save_sequences`' file) built into the folder `dest` once
    (under a lock, in a temporary folder renamed into place) and rebuilt when the asset changes; returns `dest`."""
    stamp = hashlib.sha256(Path(asset).read_bytes()).hexdigest()[:16]
    mark = dest.parent / f"{dest.name}.source"

    def current() -> bool:
        return (dest / "dynamic.bin").is_file() and (dest / "static.bin").is_file() and mark.is_file() \
            and mark.read_text() == stamp

    if current():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".lookup-cache.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if current():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            seqs, _ = load_sequences(asset)
            info = build(seqs, tmp)
            (tmp / "build.json").write_text(json.dumps({**info, "asset": str(asset), "asset_sha256": stamp}) + "\n")
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            os.chmod(tmp, 0o755)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
            mark.write_text(stamp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
