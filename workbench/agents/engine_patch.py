"""Engine patches the built-in tuner applies before a config search (#24): changes to llama.cpp outside its
kernels that give a mechanism a knob upstream lacks (`decoder/engines/patches/patches.toml`), e.g. a cap on
ngram-cache's draft length, fixed at 8 upstream, so that a verify forward is only as wide as the drafts that
tend to be accepted.

For a workspace that carries the engine's source and a direction of a patch's family, the tuner commits the
patches its base lacks, searches configs on the engine rebuilt from them (a config needing a patch's flag is
refused on an engine without it: `Workspace.refusal`), and keeps a patch only when the winning config uses
its flag; otherwise the branch is reset to where it was. Forcing and the cascade's paired benchmark judge the
result like any other change.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from decoder.engines.llamacpp_config import PATCHED_FLAGS
from workbench.engine_source import carries

LIBRARY = Path(__file__).resolve().parents[2] / "decoder" / "engines" / "patches" / "patches.toml"


@dataclass(frozen=True)
class EnginePatch:
    name: str
    family: str
    patch: Path
    flag: str
    summary: str

    def text(self) -> str:
        return self.patch.read_text()


def library(path: Path = LIBRARY) -> list[EnginePatch]:
    """The known engine patches."""
    data = tomllib.loads(path.read_text())
    return [EnginePatch(str(p["name"]), str(p["family"]), path.parent / str(p["patch"]), str(p["flag"]),
                        str(p.get("summary", ""))) for p in data.get("patch", [])]


def by_flag(flag: str) -> EnginePatch | None:
    """The library's patch that adds `flag`, None when no patch does."""
    name = PATCHED_FLAGS.get(flag)
    return next((p for p in library() if p.name == name and p.flag == flag), None)


def applicable(ws, commit: str, family: str) -> list[EnginePatch]:
    """The library's patches for `family` that `commit` does not carry yet; none when the workspace does not
    carry the engine's source (a prebuilt engine cannot take a patch)."""
    if not ws.config.engine_source:
        return []
    return [p for p in library() if p.family == family and not carries(ws, commit, p.text())]


def missing(ws, commit: str | None, flags: list[str]) -> str | None:
    """Why an engine at `commit` cannot take `flags` (one line), None when it can. `commit` None: the engine
    the commit will carry is not known yet, so only a workspace without the source is refused."""
    for flag in flags:
        p = by_flag(flag)
        if p is None:
            return f"{flag} is not a flag of any known engine patch"
        if not ws.config.engine_source:
            return (f"{flag} needs the engine patch {p.name}; this workspace runs a prebuilt llama.cpp "
                    f"(`specpilot init --engine llama.cpp --with-source` lets the tuner apply it)")
        if commit is not None and not carries(ws, commit, p.text()):
            return f"{flag} needs the engine patch {p.name}, which the engine source at {commit[:10]} lacks"
    return None
