"""The plain-text protocol, for endpoints and models that do not call tools: actions parsed from the reply.

A reply holds SEARCH/REPLACE blocks, each after a line naming its file, and commands on lines of their own:

    system.toml
    <<<<<<< SEARCH
    draft_len = 3
    =======
    draft_len = 4
    >>>>>>> REPLACE
    SMOKE
    FINISH draft_len_4: draft four tokens a step

Commands (upper case, at the start of a line): LIST [path], READ path [start [end]], GREP pattern [path],
SMOKE, FINISH name: summary. A block with no file line before it is applied to the one file whose text its
SEARCH part matches (the agent looks). Anything else in the reply (prose, fences) is ignored; a reply with no
block and no command is not actionable.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from workbench.agents.edits import SEARCH_RE, EditBlock, EditError, parse_blocks

COMMAND_RE = re.compile(r"^\s*(?:[-*>]\s*)?`{0,3}\s*(LIST|READ|GREP|SMOKE|FINISH)\b:?\s*(.*?)\s*`{0,3}\s*$")
_END_RE = re.compile(r"^\s*>{5,9} ?REPLACE\s*$")
_PATH_RE = re.compile(r"^[\w.-]+(?:/[\w.-]+)*\.\w+$|^[\w.-]+/[\w./-]+$")


@dataclass
class Action:
    kind: str  # list, read, grep, edit, smoke, finish, error (a part that could not be parsed)
    args: dict[str, str] = field(default_factory=dict)
    blocks: list[EditBlock] = field(default_factory=list)  # edit only

    def describe(self) -> str:
        if self.kind == "edit":
            return f"EDIT {self.args.get('path') or '(file found by its SEARCH text)'}"
        if self.kind == "error":
            return "unparsed block"
        return " ".join([self.kind.upper(), *(v for v in self.args.values() if v)])[:160]


TEXT_RULES = """You cannot call tools here. Act by writing plain text in this form, and nothing else is read:
- To change a file: a line with its path, then one or more blocks
path/to/file.py
<<<<<<< SEARCH
lines copied exactly from the file
=======
the new lines
>>>>>>> REPLACE
- Commands, each on its own line: LIST [folder] | READ path [first_line [last_line]] | GREP pattern [path] | \
SMOKE (runs your committed change on one prompt) | FINISH name: one-line summary (hands in your change and ends).
The results come back in the next message."""

TEXT_NUDGE = ("Your reply had no SEARCH/REPLACE block and no command, so nothing was done. Reply with a block "
              "that changes a file (its path on the line before '<<<<<<< SEARCH'), or a command such as "
              "READ system.toml, or FINISH name: summary. This is the last reminder: another reply without an "
              "action ends your work.")


def _path_line(line: str) -> str | None:
    """The file path a line names (`path`, `path:`, `File: path`, `**path**`, `# path`), or None."""
    s = line.strip().strip("`*").strip()
    s = re.sub(r"^(?:#+\s*|(?:file|path|edit)\s*:?\s*)", "", s, flags=re.I).strip().strip("`*:").strip()
    return s if _PATH_RE.match(s) and len(s) < 200 else None


def parse_reply(text: str) -> list[Action]:
    """The actions in a reply, in order (see the module docstring); [] when it holds none."""
    actions: list[Action] = []
    lines = text.splitlines(keepends=True)
    path: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if SEARCH_RE.match(line):
            j = i + 1
            while j < len(lines) and not _END_RE.match(lines[j]) and not SEARCH_RE.match(lines[j]):
                j += 1
            chunk = "".join(lines[i:j + 1])
            try:
                blocks = parse_blocks(chunk if chunk.endswith("\n") else chunk + "\n")
            except EditError as e:
                actions.append(Action("error", {"error": f"a SEARCH/REPLACE block could not be read: {e}"}))
            else:
                last = actions[-1] if actions else None
                if last is not None and last.kind == "edit" and last.args.get("path") == (path or ""):
                    last.blocks += blocks
                else:
                    actions.append(Action("edit", {"path": path or ""}, blocks))
            i = j + 1
            continue
        m = COMMAND_RE.match(line)
        if m:
            actions.append(_command(m.group(1), m.group(2)))
        elif line.strip() and not line.strip().startswith("```"):
            named = _path_line(line)
            path = named if named is not None else path if _only_markup(line) else None
        i += 1
    return actions


def _only_markup(line: str) -> bool:
    return not line.strip().strip("`*#-").strip()


def _command(name: str, rest: str) -> Action:
    try:
        words = shlex.split(rest)
    except ValueError:
        words = rest.split()
    if name == "LIST":
        return Action("list", {"path": words[0] if words else "."})
    if name == "READ":
        if not words:
            return Action("error", {"error": "READ needs a path, e.g. READ system.toml"})
        m = re.match(r"^(.*?):(\d+)(?:-(\d+))?$", words[0])  # READ path:10-40
        if m:
            return Action("read", {"path": m.group(1), "start_line": m.group(2), "end_line": m.group(3) or ""})
        return Action("read", {"path": words[0], "start_line": words[1] if len(words) > 1 else "",
                               "end_line": words[2] if len(words) > 2 else ""})
    if name == "GREP":
        if not words:
            return Action("error", {"error": "GREP needs a pattern, e.g. GREP draft_len"})
        return Action("grep", {"pattern": words[0], "path": words[1] if len(words) > 1 else "."})
    if name == "SMOKE":
        return Action("smoke")
    mech, _, summary = rest.partition(":")
    if not summary.strip():  # FINISH name summary words...
        mech, _, summary = rest.strip().partition(" ")
    return Action("finish", {"mechanism_name": mech.strip(), "summary": summary.strip() or mech.strip()})


def signature(content: str, tool_calls: list[tuple[str, str]]) -> str:
    """What makes two replies the same: their text with whitespace collapsed and their tool calls."""
    return " ".join(content.split()) + "\x00" + "\x00".join(f"{n}\x01{' '.join(a.split())}" for n, a in tool_calls)
