"""SEARCH/REPLACE edit blocks: parse them, apply them tolerantly, and explain the ones that do not apply.

The format is the usual one:

    <<<<<<< SEARCH
    lines copied from the file
    =======
    the lines that replace them
    >>>>>>> REPLACE

Matching works on whole lines and tries, in order: the exact lines; the lines with trailing whitespace
ignored; the lines with all leading and trailing whitespace ignored (the replacement is then re-indented by
the same offset). A block whose SEARCH text occurs more than once is refused rather than guessed. A block
that does not apply is reported with the file's nearest lines (best fuzzy match, with line numbers) so a
model can correct it.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

SEARCH_RE = re.compile(r"^\s*<{5,9} ?SEARCH\s*$")
DIVIDER_RE = re.compile(r"^\s*={5,9}\s*$")
REPLACE_RE = re.compile(r"^\s*>{5,9} ?REPLACE\s*$")
HINT_CONTEXT = 2  # lines shown around the nearest match
HINT_CANDIDATES = 24  # windows scored with the full (slow) ratio after the quick prefilter


class EditError(ValueError):
    """A block that cannot be parsed or applied; the message is meant for the model, with line numbers."""


@dataclass
class EditBlock:
    search: str
    replace: str


def _part(lines: list[str], i: int, end: re.Pattern, wrong: tuple[re.Pattern, ...], where: str, marker: str,
          missing: str) -> tuple[list[str], int]:
    """The lines of a block's part from line i up to the `end` marker, and the index after the marker."""
    part: list[str] = []
    while i < len(lines) and not end.match(lines[i]):
        if any(r.match(lines[i]) for r in wrong):
            raise EditError(f"{where}: expected {marker} before {lines[i].strip()!r}")
        part.append(lines[i])
        i += 1
    if i == len(lines):
        raise EditError(f"{where}: no {marker} line {missing}")
    return part, i + 1


def parse_blocks(text: str) -> list[EditBlock]:
    """The SEARCH/REPLACE blocks in `text`, in order; anything between blocks (a fence, prose) is ignored."""
    blocks: list[EditBlock] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if not SEARCH_RE.match(lines[i]):
            if DIVIDER_RE.match(lines[i]) or REPLACE_RE.match(lines[i]):
                raise EditError(f"line {i + 1} of blocks: {lines[i].strip()!r} outside a block; each block starts "
                                f"with '<<<<<<< SEARCH'")
            i += 1
            continue
        n = len(blocks) + 1
        where = f"block {n} (line {i + 1})"
        search, i = _part(lines, i + 1, DIVIDER_RE, (SEARCH_RE, REPLACE_RE), where, "'======='",
                          "after the SEARCH part")
        replace, i = _part(lines, i, REPLACE_RE, (SEARCH_RE, DIVIDER_RE), where, "'>>>>>>> REPLACE'", "to close it")
        blocks.append(EditBlock("".join(search), "".join(replace)))
    if not blocks:
        raise EditError("no SEARCH/REPLACE block found; write '<<<<<<< SEARCH', the old lines, '=======', "
                        "the new lines, '>>>>>>> REPLACE'")
    return blocks


def apply_blocks(content: str | None, blocks: list[EditBlock]) -> str:
    """`content` with every block applied in order; all or nothing (raises EditError naming the failed block).

    `content` None means the file does not exist: only a block with an empty SEARCH part may create it.
    """
    text = content
    for n, block in enumerate(blocks, 1):
        try:
            text = apply_block(text, block)
        except EditError as e:
            prefix = f"block {n} of {len(blocks)}" if len(blocks) > 1 else "the block"
            if n > 1:
                prefix += f" (matched against the file as block{'s 1-' if n > 2 else ' '}{n - 1} would leave it)"
            raise EditError(f"{prefix}: {e}") from None
    assert text is not None
    return text


def apply_block(content: str | None, block: EditBlock) -> str:
    """`content` with one block applied (see apply_blocks)."""
    if not block.search.strip():
        if content is None or not content.strip():
            return block.replace
        raise EditError("SEARCH is empty but the file is not; copy the lines to replace into SEARCH "
                        "(an empty SEARCH only creates a new file)")
    if content is None:
        raise EditError("the file does not exist; to create it, leave SEARCH empty")
    lines = content.splitlines(keepends=True)
    s_lines = block.search.splitlines(keepends=True)
    r_lines = block.replace.splitlines(keepends=True)
    for how, key in (("exactly", _same), ("ignoring trailing whitespace", str.rstrip),
                     ("ignoring indentation", str.strip)):
        hits = _line_matches(lines, s_lines, key)
        if len(hits) > 1:
            raise EditError(_ambiguous(hits, how))
        if hits:
            at = hits[0]
            found = lines[at:at + len(s_lines)]
            new = _reindent(r_lines, s_lines, found) if key is str.strip else r_lines
            new = _keep_final_newline(_keep_crlf(new, found), found)
            return "".join(lines[:at] + new + lines[at + len(s_lines):])
    raise EditError("SEARCH does not match the file (not even ignoring whitespace). " + nearest_lines(lines, s_lines))


def _line_matches(lines: list[str], s_lines: list[str], key) -> list[int]:
    want = [key(s) for s in s_lines]
    have = [key(s) for s in lines]
    m = len(want)
    return [i for i in range(len(have) - m + 1) if have[i:i + m] == want]


def _same(line: str) -> str:
    return line


def _ambiguous(hits: list[int], how: str) -> str:
    where = ", ".join(str(h + 1) for h in hits[:8])
    return (f"SEARCH matches {len(hits)} places ({how}), starting at lines {where}; "
            f"add surrounding lines to SEARCH so it matches one place only")


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _reindent(r_lines: list[str], s_lines: list[str], found: list[str]) -> list[str]:
    """Shift the replacement by the indentation offset between the SEARCH text and the file's lines."""
    pairs = [(s, f) for s, f in zip(s_lines, found, strict=True) if s.strip()]
    if not pairs:
        return r_lines
    s_ind, f_ind = _indent(pairs[0][0]), _indent(pairs[0][1])
    if f_ind.startswith(s_ind):
        extra = f_ind[len(s_ind):]
        return [extra + r if r.strip() else r for r in r_lines]
    if s_ind.startswith(f_ind):
        cut = s_ind[len(f_ind):]
        return [r[len(cut):] if r.startswith(cut) else r.lstrip(" \t") if r.strip() else r for r in r_lines]
    return r_lines


def _keep_crlf(new: list[str], found: list[str]) -> list[str]:
    # A model writes "\n"; in a CRLF file the replacement takes the file's line ending.
    if not found or not found[0].endswith("\r\n"):
        return new
    return [r[:-1] + "\r\n" if r.endswith("\n") and not r.endswith("\r\n") else r for r in new]


def _keep_final_newline(new: list[str], found: list[str]) -> list[str]:
    # The block's last line ends with "\n" (it is followed by the divider); the file's may not (end of file).
    if new and found and not found[-1].endswith("\n") and new[-1].endswith("\n"):
        return new[:-1] + [new[-1].rstrip("\n")]
    if new and found and found[-1].endswith("\n") and not new[-1].endswith("\n"):
        return new[:-1] + [new[-1] + "\n"]
    return new


def nearest_lines(lines: list[str], s_lines: list[str]) -> str:
    """The file's lines that look most like the SEARCH text, numbered, as a hint for the retry."""
    if not lines:
        return "The file is empty."
    m = max(1, len(s_lines))
    want = "".join(s.strip() + "\n" for s in s_lines)
    starts = range(max(1, len(lines) - m + 1))
    windows = {i: "".join(x.strip() + "\n" for x in lines[i:i + m]) for i in starts}
    quick = sorted(starts, key=lambda i: difflib.SequenceMatcher(None, want, windows[i]).quick_ratio(), reverse=True)
    best, best_ratio = 0, -1.0
    for i in quick[:HINT_CANDIDATES]:
        r = difflib.SequenceMatcher(None, want, windows[i]).ratio()
        if r > best_ratio:
            best, best_ratio = i, r
    lo, hi = max(0, best - HINT_CONTEXT), min(len(lines), best + m + HINT_CONTEXT)
    shown = "".join(f"{k + 1:>5} | {lines[k].rstrip()}\n" for k in range(lo, hi))
    return (f"Nearest lines in the file ({best_ratio:.0%} similar, lines {best + 1}-{min(len(lines), best + m)}; "
            f"copy SEARCH from them exactly, without the line numbers):\n{shown}")
