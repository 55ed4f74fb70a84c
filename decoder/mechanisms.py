"""The decoder's mechanism registry: what the tuner may switch on and tune, all off in stock.

The entries are rows of a table, decoder/mechanisms.toml (one [[mechanism]] each). Each names its
DecodeConfig keys with their ranges, the gap family it closes (the cost model's families), and when it
applies. Stock is `DecodeConfig()` with every mechanism at its `stock` value; a candidate is stock plus
changes to these keys only.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from decoder.config import FEATURE_NEEDS, TREE_NEEDS, ConfigError, DecodeConfig, verify_width
from decoder.engines.llamacpp_config import LlamaCppConfig

# What the tuner sets with a tree mechanism: the lean forward too (on a recurrent target, where it cannot run,
# Workspace.refusal drops the candidate: tree verification there is the HF path's, set by hand or by an agent).
TREE_MECHANISM_NEEDS = {**{k: v for k, v in TREE_NEEDS.items() if k != "cuda_graphs"}, "lean_forward": True}


@dataclass(frozen=True)
class Mechanism:
    name: str
    family: str
    keys: dict[str, tuple]  # DecodeConfig key -> allowed values (a tuple of choices)
    stock: dict[str, object]  # the value of each key in stock
    applies: str  # when the mechanism can help, in one line
    summary: str
    requires: dict[str, object] = field(default_factory=dict)  # other keys it needs (e.g. method = "sd")
    devices: tuple[str, ...] = ("cpu", "cuda")  # where it can pay off (a tuner skips it elsewhere)


REGISTRY_FILE = Path(__file__).with_name("mechanisms.toml")
NEEDS = {"tree": TREE_MECHANISM_NEEDS, "feature": FEATURE_NEEDS}  # the shared requirement sets a row may name


def _mechanism(row: dict) -> Mechanism:
    """One [[mechanism]] row of the table: its value lists become the tuples of choices."""
    requires = {**NEEDS[row["needs"]], **row.get("requires", {})} if "needs" in row else row.get("requires", {})
    return Mechanism(name=row["name"], family=row["family"], keys={k: tuple(v) for k, v in row["keys"].items()},
                     stock=row["stock"], applies=row["applies"], summary=row["summary"], requires=requires,
                     devices=tuple(row.get("devices", ("cpu", "cuda"))))


def load_registry(path: Path = REGISTRY_FILE) -> dict[str, Mechanism]:
    """The mechanisms of the table at `path` (decoder/mechanisms.toml), by name, in its order."""
    return {m.name: m for m in map(_mechanism, tomllib.loads(path.read_text(encoding="utf-8"))["mechanism"])}


REGISTRY: dict[str, Mechanism] = load_registry()


LLAMA_CPP_REGISTRY_FILE = Path(__file__).parent / "engines" / "llamacpp_mechanisms.toml"
LLAMA_CPP_REGISTRY: dict[str, Mechanism] = load_registry(LLAMA_CPP_REGISTRY_FILE)
ENGINES = ("torch", "llama.cpp")  # a workspace's [system] engine: whose config contract system.toml holds


@dataclass(frozen=True)
class Contract:
    """A system's config contract: the config class of its system.toml, the mechanisms the tuner composes on
    it, and the keys that make it plain AR (the loop's reference)."""

    engine: str
    config: type  # DecodeConfig or LlamaCppConfig: from_table, as_dict, to_toml, validate (ConfigError)
    registry: dict[str, Mechanism]
    ar: dict[str, object]

    def verify_width(self, table: dict) -> int:
        """Tokens one verify forward of the config in `table` may hold (1 for AR)."""
        if self.config is LlamaCppConfig:  # a candidate's malformed table reads as stock's width
            try:
                return LlamaCppConfig.from_table(table, known_only=True).verify_width()
            except (ConfigError, TypeError):
                return 1
        return verify_width(table)


CONTRACTS = {"torch": Contract("torch", DecodeConfig, REGISTRY, {"method": "ar"}),
             "llama.cpp": Contract("llama.cpp", LlamaCppConfig, LLAMA_CPP_REGISTRY, {"spec_type": "none"})}


def contract_for(engine: str) -> Contract:
    """The config contract of a workspace's engine (ValueError naming the known ones)."""
    if engine not in CONTRACTS:
        raise ValueError(f"engine {engine!r}: choose one of {', '.join(ENGINES)}")
    return CONTRACTS[engine]


def stock_config() -> DecodeConfig:
    return DecodeConfig()


def validate_change(changes: dict[str, object]) -> None:
    """Reject a candidate change that touches keys outside the registry or leaves their ranges."""
    allowed: dict[str, set] = {}
    for m in REGISTRY.values():
        for k, values in m.keys.items():
            allowed.setdefault(k, set()).update(values)
    for k, v in changes.items():
        if k not in allowed:
            raise ValueError(f"mechanism change: {k} is not a mechanism key; known: {', '.join(sorted(allowed))}")
        if v not in allowed[k]:
            raise ValueError(f"mechanism change: {k} = {v!r} is outside its range {sorted(allowed[k], key=str)}")
