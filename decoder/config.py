"""DecodeConfig: every knob of one decoding method, with a TOML round trip."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

METHODS = ("ar", "sd")
DRAFTERS = ("draft-model", "ngram")
DTYPES = ("bfloat16", "float32", "float16")


class ConfigError(ValueError):
    """A config value a user wrote is invalid; the message names the key, the value and the fix."""


@dataclass
class DecodeConfig:
    method: str = "sd"  # "ar" (target alone) or "sd" (chain speculative decoding)
    drafter: str = "draft-model"  # "draft-model" or "ngram" (prompt lookup)
    draft_len: int = 3  # k: tokens drafted per step (an n-gram match may give fewer)
    ngram_max: int = 4  # longest suffix the n-gram drafter tries to match
    ngram_min: int = 1  # shortest suffix it accepts as a match
    temperature: float = 0.0  # 0 = greedy; > 0 = lossless rejection sampling
    top_p: float = 1.0  # kept at 1.0: the speculative sampler is exact for the tempered distribution only
    seed: int = 0
    max_new_tokens: int = 128
    stop_at_eos: bool = True
    lean_forward: bool = False  # mechanism lean_forward (host-overhead): fused, preallocated-KV forward
    cuda_graphs: bool = False  # mechanism cuda-graphs: static bucketed steps (decoder/lean.py), captured on CUDA
    weight_format: str = "bf16"  # mechanism w12-weights: "w12" swaps the target's linears (kernels/w12.py)
    # Batching mechanisms (decoder/batch.py; used by the batched engine only, all off in stock).
    ragged_verify: bool = False  # mechanism ragged-verify: forwards compute real rows only, no padded rectangle
    load_aware_draft: bool = False  # mechanism load-aware-drafting: per-request k from batch load and acceptance
    load_aware_fixed_rows: int = 64  # its cost model: a forward's fixed cost in target rows (weights read, overhead)
    continuous_batching: bool = False  # mechanism continuous-batching: finished requests leave, new ones join
    dtype: str = "bfloat16"
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"decode config: {key} = {getattr(self, key)!r} is invalid: {why}")

        if self.method not in METHODS:
            raise bad("method", f"choose one of {', '.join(METHODS)}")
        if self.drafter not in DRAFTERS:
            raise bad("drafter", f"choose one of {', '.join(DRAFTERS)}")
        if not 1 <= self.draft_len <= 32:
            raise bad("draft_len", "use 1 to 32")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise bad("ngram_min", f"need 1 <= ngram_min <= ngram_max (= {self.ngram_max}) <= 16")
        if self.temperature < 0:
            raise bad("temperature", "use 0 for greedy or a positive value for sampling")
        if self.top_p != 1.0:
            raise bad("top_p", "only 1.0 is supported")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", "generate at least 1 token")
        if self.cuda_graphs and not self.lean_forward:
            raise bad("cuda_graphs", "the static step is built on the lean forward; set lean_forward = true")
        if self.weight_format not in ("bf16", "w12"):
            raise bad("weight_format", "choose bf16 or w12")
        if self.weight_format == "w12" and self.lean_forward:
            raise bad("weight_format", "w12 does not combine with lean_forward yet; turn one off")
        if not 1 <= self.load_aware_fixed_rows <= 4096:
            raise bad("load_aware_fixed_rows", "use 1 to 4096 (target rows one forward's fixed cost is worth)")
        if self.load_aware_draft and self.method != "sd":
            raise bad("load_aware_draft", "it chooses draft lengths; set method = \"sd\" or turn it off")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"choose one of {', '.join(DTYPES)}")

    def to_toml(self) -> str:
        lines = ["[decode]"]
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                s = "true" if v else "false"
            elif isinstance(v, (int, float)):
                s = repr(v)
            else:
                s = '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
            lines.append(f"{f.name} = {s}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str) -> DecodeConfig:
        data = tomllib.loads(text)
        table = data.get("decode", data)
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ConfigError(f"decode config: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        kwargs = {}
        for k, v in table.items():
            default = getattr(cls(), k) if k != "method" else "sd"
            if isinstance(default, float) and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if type(v) is not type(default):
                raise ConfigError(f"decode config: {k} = {v!r} should be of type {type(default).__name__}")
            kwargs[k] = v
        return cls(**kwargs)

    @classmethod
    def load(cls, path: Path) -> DecodeConfig:
        return cls.from_toml(Path(path).read_text())

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_toml())

    def as_dict(self) -> dict:
        return asdict(self)
