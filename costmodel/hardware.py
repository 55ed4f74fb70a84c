"""Hardware profiles: datasheet GPUs, and `cpu-local` measured on the machine it runs on.

A profile holds what the roofline needs (memory bandwidth, dense matmul peaks) and, when measured
or fitted, what the roofline misses: a fixed cost per forward and a cost per layer (kernel launches,
Python module overhead), and the throughput a real matmul achieves. Profiles are JSON files under
`<data dir>/hardware/<name>.json`; the data dir is `$SPECPILOT_DATA_DIR` or
`~/.local/share/specpilot`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from decoder.contract import data_dir

# Weight formats compute in these dtypes: weight-only formats (12-bit, int8) dequantize to bf16.
COMPUTE_DTYPES = ("fp32", "bf16", "fp8")


class HardwareError(ValueError):
    """A hardware profile cannot be found or read; the message says which and what to do."""


@dataclass
class HardwareProfile:
    """What one machine can move and compute, from a datasheet or measured here."""

    name: str
    mem_bandwidth_GBps: float  # datasheet peak, or measured copy bandwidth (read + write) for cpu-local
    bf16_tflops: float  # dense (no 2:4 sparsity), bf16 inputs with fp32 accumulate
    fp8_tflops: float | None  # dense; None where the part has no fp8 tensor cores
    l2_MB: float
    fp32_tflops: float | None = None  # dense fp32 without tensor cores (TF32 is not fp32)
    source: str = ""  # vendor datasheet, or "measured on <host>"
    # Measured or fitted; zero / None means "not measured": the pure roofline.
    fixed_overhead_ms: float = 0.0  # per forward, independent of the model's size
    per_layer_overhead_ms: float = 0.0  # per decoder layer per forward
    achieved_bandwidth_GBps: float | None = None  # fitted on real forwards; replaces the peak in step times
    achieved_bf16_tflops: float | None = None  # best measured matmul throughput at decode shapes
    achieved_fp32_tflops: float | None = None
    # Fitted on batched forwards (`profile hardware` with a step sweep): the rate a forward gets through its
    # requests' KV caches and recurrent state. Set, that traffic is a term of its own after the weights /
    # compute roofline (attention runs as ops of its own, between the matmuls, and on this CPU moves each
    # request's cache several times: concatenated, expanded for GQA); None, it shares the memory term.
    kv_bandwidth_GBps: float | None = None
    measured: dict = field(default_factory=dict)  # raw measurements: curves, validation sweep, threads

    def bandwidth_GBps(self) -> float:
        """Bandwidth the step model uses: the fitted one when there is one, else the peak."""
        return self.achieved_bandwidth_GBps or self.mem_bandwidth_GBps

    def peak_tflops(self, compute_dtype: str) -> float:
        """Matmul throughput for `compute_dtype` (fp32, bf16, fp8): achieved when measured, else datasheet."""
        if compute_dtype not in COMPUTE_DTYPES:
            raise HardwareError(f"compute dtype {compute_dtype!r} is unknown; use one of {', '.join(COMPUTE_DTYPES)}")
        bf16 = self.achieved_bf16_tflops or self.bf16_tflops
        if compute_dtype == "bf16":
            return bf16
        if compute_dtype == "fp8":
            # No fp8 units: fp8 weights are upcast and run at the bf16 rate.
            return self.fp8_tflops or bf16
        fp32 = self.achieved_fp32_tflops or self.fp32_tflops
        return fp32 or bf16

    def overhead_ms(self, num_layers: int) -> float:
        """Fixed cost of one forward of a model with `num_layers` layers."""
        return self.fixed_overhead_ms + self.per_layer_overhead_ms * num_layers

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HardwareProfile:
        known = {f.name for f in fields(cls)}
        missing = [k for k in ("name", "mem_bandwidth_GBps", "bf16_tflops", "fp8_tflops", "l2_MB") if k not in data]
        if missing:
            raise HardwareError(f"hardware profile lacks {', '.join(missing)}; re-create it with "
                                f"`specpilot profile hardware`")
        return cls(**{k: v for k, v in data.items() if k in known})


# Datasheet profiles: dense peaks (the datasheets print 2:4-sparse figures with an asterisk; halve those).
DATASHEETS: dict[str, HardwareProfile] = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 3.35 TB/s HBM3, BF16 1,979 TFLOPS sparse,
    # FP8 3,958 sparse, FP32 67 TFLOPS; 50 MB L2 (NVIDIA H100 Tensor Core GPU Architecture whitepaper).
    "h100-sxm": HardwareProfile("h100-sxm", 3350.0, 989.4, 1978.9, 50.0, 67.0,
                                source="NVIDIA H100 Tensor Core GPU datasheet (SXM)"),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: 4.8 TB/s HBM3e, same tensor cores as H100 SXM;
    # 50 MB L2 (same GH100 die).
    "h200": HardwareProfile("h200", 4800.0, 989.4, 1978.9, 50.0, 67.0,
                            source="NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    # NVIDIA HGX B200 datasheet (per GPU, 1,000 W): 8 TB/s HBM3e, BF16 4.5 PFLOPS sparse, FP8 9 PFLOPS
    # sparse, FP32 75 TFLOPS. L2 is not on the datasheet and third-party spec tables disagree
    # (65.5-126 MB for the two dies); 126 MB is approximate and nothing here depends on it.
    "b200": HardwareProfile("b200", 8000.0, 2250.0, 4500.0, 126.0, 75.0,
                            source="NVIDIA HGX B200 datasheet (per GPU)"),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: 2,039 GB/s HBM2e, BF16 312 TFLOPS
    # dense, FP32 19.5 TFLOPS, no fp8; 40 MB L2 (NVIDIA A100 Tensor Core GPU Architecture whitepaper).
    "a100-80gb": HardwareProfile("a100-80gb", 2039.0, 312.0, None, 40.0, 19.5,
                                 source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)"),
    # NVIDIA L40S datasheet: 864 GB/s GDDR6, BF16 733 TFLOPS sparse, FP8 1,466 sparse, FP32 91.6 TFLOPS;
    # 96 MB L2 (NVIDIA Ada Lovelace architecture whitepaper, AD102).
    "l40s": HardwareProfile("l40s", 864.0, 362.05, 733.0, 96.0, 91.6,
                            source="NVIDIA L40S GPU datasheet"),
    # NVIDIA Ada Lovelace GPU architecture whitepaper, appendix (GeForce RTX 4090): 1,008 GB/s GDDR6X,
    # BF16 with FP32 accumulate 165.2 TFLOPS dense, FP8 with FP32 accumulate 330.3 dense, FP32 82.6;
    # 72 MB L2.
    "rtx-4090": HardwareProfile("rtx-4090", 1008.0, 165.2, 330.3, 72.0, 82.6,
                                source="NVIDIA Ada Lovelace GPU architecture whitepaper (RTX 4090)"),
}

LOCAL = "cpu-local"


def profile_path(name: str) -> Path:
    """Default file of the stored profile `name`."""
    return data_dir() / "hardware" / f"{name}.json"


PROFILE_DTYPES = ("bfloat16", "float32")  # what `measure_cpu_local` times the model's forwards in


def local_profile_path(dtype: str) -> Path:
    """Where this machine's profile measured with the model in `dtype` is kept: `cpu-local.json` for bfloat16
    (as always), `cpu-local-float32.json` for float32. A float32 workspace fitted to bfloat16 forwards would
    rank its gaps on the wrong costs (on a CPU without native bfloat16 every bf16 matmul is converted)."""
    return profile_path(LOCAL if dtype == "bfloat16" else f"{LOCAL}-{dtype}")


def save_profile(profile: HardwareProfile, path: Path | str | None = None) -> Path:
    """Write `profile` as JSON (default: its place in the data dir); return the path."""
    path = Path(path) if path is not None else profile_path(profile.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a profile
    return path


def load_profile(path: Path | str) -> HardwareProfile:
    """Read a profile written by `save_profile`."""
    path = Path(path)
    if not path.is_file():
        raise HardwareError(f"no hardware profile at {path}; run `specpilot profile hardware` to measure this machine")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HardwareError(f"{path} is not valid JSON ({e.msg}); delete it and run "
                            f"`specpilot profile hardware`") from e
    if not isinstance(data, dict):
        raise HardwareError(f"{path} does not hold a JSON object; delete it and run `specpilot profile hardware`")
    return HardwareProfile.from_dict(data)


def available_profiles() -> list[str]:
    """Datasheet names plus the profiles stored in the data dir."""
    stored = sorted(p.stem for p in (data_dir() / "hardware").glob("*.json"))
    return sorted(set(DATASHEETS) | set(stored))


def get_profile(name: str) -> HardwareProfile:
    """A stored profile (measured or fitted) if one exists under `name`, else the datasheet one."""
    stored = profile_path(name)
    if stored.is_file():
        return load_profile(stored)
    if name in DATASHEETS:
        return replace(DATASHEETS[name], measured=dict(DATASHEETS[name].measured))
    if name == LOCAL:
        raise HardwareError(f"--hardware {LOCAL}: not measured yet (no {stored}); run `specpilot profile hardware "
                            f"[--model DIR]` first, or pick a datasheet GPU: {', '.join(sorted(DATASHEETS))}")
    raise HardwareError(f"--hardware {name}: unknown; choose one of {', '.join(available_profiles() + [LOCAL])}")


# A cpu-local profile is measured PROFILE_REPEATS times; the quietest run is kept, and a profile whose
# runs differ by more than MAX_PROFILE_SPREAD (a loaded machine) is refused where it bounds a decision
# (the loop's plausibility ceiling).
PROFILE_REPEATS, MAX_PROFILE_SPREAD = 3, 0.5


def profile_spread(profile: HardwareProfile) -> float | None:
    """The recorded spread of a repeated measurement ((max - min) / min of the forward time), or None
    when the profile was measured once (or is a datasheet)."""
    spread = profile.measured.get("spread")
    return float(spread) if spread is not None else None
