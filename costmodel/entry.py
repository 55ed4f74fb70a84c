"""The cost model's reading of a measured method: `decoder.stats.MethodEntry` (one entry of `specpilot bench
--json`'s "methods", or the harness's profile of a running system, `workbench/measure.py: profile_entry`),
checked for the fields the measured gaps (`costmodel/gaps.py`) cannot do without.

The record itself lives in `decoder/stats.py` (torch-free, read tolerantly); this module adds the strict
check: an entry the gaps cannot split is a GapError naming the field and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping

from decoder.stats import PHASES, MethodEntry

__all__ = ["GapError", "MethodEntry", "read_entry"]


class GapError(ValueError):
    """A method entry the cost model cannot split; the message names the field and the fix."""


def read_entry(entry: MethodEntry | Mapping) -> MethodEntry:
    """The entry as a MethodEntry with every phase of `phase_ms_per_token` and tau > 0, else a GapError."""
    if isinstance(entry, Mapping) and not isinstance(entry, dict):
        entry = dict(entry)
    if not isinstance(entry, MethodEntry | dict):
        raise GapError(f"a method entry is a JSON object, not {type(entry).__name__}")
    raw_tau = entry.get("tau") if isinstance(entry, dict) else entry.tau
    e = entry if isinstance(entry, MethodEntry) else MethodEntry.from_dict(entry)
    if e.phase_ms_per_token is None:
        raise GapError(f"method {e.name} has no phase_ms_per_token; use one of our methods (ar, sd-draft-model, "
                       f"sd-ngram) from `specpilot bench --json`")
    missing = [p for p in PHASES if p not in e.phase_ms_per_token]
    if missing:
        raise GapError(f"method {e.name}: phase_ms_per_token lacks {', '.join(missing)}; re-run `specpilot bench`")
    if not e.tau:
        raise GapError(f"method {e.name}: tau {raw_tau!r} must be positive; re-run `specpilot bench`")
    return e
