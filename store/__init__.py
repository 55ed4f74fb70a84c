"""The SQLite memory of deployments, runs, branches, forcing reports and mechanisms (see DESIGN.md).

`Memory(path)` opens (and migrates) one memory database and is the repository API; `store.db` holds
the connection settings, default locations and migration runner, `store.migrations` the schema.
"""

from store.db import (
    NotFound,
    StoreError,
    data_dir,
    global_memory_path,
    workspace_memory_path,
)
from store.migrations import EVALUATION_STATUSES, GAP_FAMILIES, LATEST_VERSION, MECHANISM_STATUSES
from store.records import (
    BenchRun,
    Branch,
    Deployment,
    Evaluation,
    Event,
    ForcingReport,
    HardwareProfile,
    Mechanism,
    Round,
    to_dict,
)
from store.repo import Memory

__all__ = [
    "EVALUATION_STATUSES", "GAP_FAMILIES", "LATEST_VERSION", "MECHANISM_STATUSES",
    "BenchRun", "Branch", "Deployment", "Evaluation", "Event", "ForcingReport", "HardwareProfile", "Mechanism",
    "Memory", "NotFound", "Round", "StoreError",
    "data_dir", "global_memory_path", "to_dict", "workspace_memory_path",
]
