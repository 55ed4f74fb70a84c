"""A deployment as the cost model sees it: machine, target, drafter, draft length, regime.

`demo_deployment()` describes the embedded demo (decoder/assets/demo) on this machine's measured
`cpu-local` profile, with the bench's defaults (draft model, k = 3, one request).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from costmodel.ceiling import Ceiling, ceiling
from costmodel.hardware import LOCAL, HardwareProfile, get_profile
from costmodel.model_profile import ModelProfile, bytes_per_weight, load_model_profile
from costmodel.step import Drafter

DEMO_DRAFT_LEN = 3  # `specpilot bench --draft-len` default (DecodeConfig's draft_len)
MAX_ORACLE_DRAFT_LEN = 32  # the widest verify bucket of the lean forward
DEMO_CONTEXT = 384  # demo prompts are ~300 tokens; 128 new tokens put the mean context near 384


@dataclass(frozen=True)
class CostDeployment:
    """Everything the roofline needs to price a step and state ceilings."""

    name: str
    hardware: HardwareProfile
    target: ModelProfile
    drafter: Drafter
    draft_len: int
    batch: int = 1
    context: int = 1024
    fmt: str = "bf16"

    def __post_init__(self) -> None:
        bytes_per_weight(self.fmt)
        if self.draft_len < 1:
            raise ValueError(f"--draft-len {self.draft_len}: must be at least 1")
        if self.batch < 1:
            raise ValueError(f"--batch {self.batch}: must be at least 1")
        if self.context < 0:
            raise ValueError(f"--context {self.context}: must be 0 or more tokens")

    def ceiling(self, tau: float | None = None, batch: int | None = None,
                ar_ms_per_token: float | None = None, sd_overheads: bool = False) -> Ceiling:
        """Ceiling with `tau` (None: oracle) at `batch` (default: the deployment's)."""
        return ceiling(self.hardware, self.target, self.drafter, self.draft_len, tau,
                       self.batch if batch is None else batch, self.context, self.fmt,
                       ar_ms_per_token=ar_ms_per_token, sd_overheads=sd_overheads)

    def oracle_ceiling(self) -> float:
        """The highest lossless speedup at this deployment's draft length (what `plausible` checks against)."""
        return self.ceiling().speedup


def demo_dir() -> Path:
    """decoder/assets/demo, found without importing the decoder (and torch)."""
    spec = importlib.util.find_spec("decoder")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the decoder package is not importable; install SpecPilot (`make demo`) "
                         "to use --deployment demo")
    return Path(next(iter(spec.submodule_search_locations))) / "assets" / "demo"


def demo_deployment(hardware: str = LOCAL, draft_len: int = DEMO_DRAFT_LEN, batch: int = 1,
                    context: int = DEMO_CONTEXT, fmt: str = "bf16") -> CostDeployment:
    """The embedded demo: its target and draft model on `hardware` (default: this machine, measured)."""
    root = demo_dir()
    for role in ("target", "drafter"):
        if not (root / role / "config.json").is_file():
            raise ValueError(f"the demo {role} is missing ({root / role / 'config.json'}); run `specpilot train demo`")
    return CostDeployment(
        name="demo", hardware=get_profile(hardware), target=load_model_profile(root / "target"),
        drafter=Drafter("model", load_model_profile(root / "drafter")), draft_len=draft_len, batch=batch,
        context=context, fmt=fmt,
    )
