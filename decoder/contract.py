"""Constants and rules every layer shares (decoder, cost model, store, workbench): a leaf module with no
imports of the project, so any layer may import it without an arrow back."""

from __future__ import annotations

import os
from pathlib import Path

# The gap families a step's time is broken into (cost model), mechanisms belong to (registry), and the
# store's mechanism rows are checked against.
GAP_FAMILIES = ("weights", "kv", "compute", "drafting", "acceptance", "batching", "host-overhead")

# A mismatch with stock is a numerical near tie when stock's top-2 logit margin there is below this many
# times the deployment's noise floor (the largest logit difference between one-token and multi-token
# forwards over the same contexts): rounding can flip such a tie, nothing else can.
NEAR_TIE_FACTOR = 2.0


def near_tie_threshold(noise_floor: float) -> float:
    """The top-2 margin below which a mismatch is a numerical near tie."""
    return NEAR_TIE_FACTOR * float(noise_floor)


def near_tie(margin: float | None, noise_floor: float) -> bool:
    """Whether a mismatch at stock's top-2 `margin` is explained as a near tie (None: no margin known)."""
    return margin is not None and margin < near_tie_threshold(noise_floor)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (the shorter one's length when one is a prefix of
    the other), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def data_dir() -> Path:
    """Where SpecPilot keeps per-user data: `$SPECPILOT_DATA_DIR`, else `~/.local/share/specpilot`."""
    env = os.environ.get("SPECPILOT_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".local" / "share" / "specpilot"
