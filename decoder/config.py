"""DecodeConfig: every knob of one decoding method, with a TOML round trip."""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Self

METHODS = ("ar", "sd")
DRAFTERS = ("draft-model", "ngram", "corpus", "block", "mtp", "routed")
# Drafters that look tokens up instead of running a forward: prompt lookup, and prompt lookup backed by a corpus
# datastore (mechanism corpus-drafter, decoder/datastore.py: TARGET/drafters/corpus.npz).
LOOKUP_DRAFTERS = ("ngram", "corpus")
CORPUS_BRANCH_LEN = 2  # mechanism corpus-tree: a branch is the alternative token and the corpus's next one
FEATURE_DRAFTERS = ("block", "mtp", "routed")  # read the target's hidden states (decoder/featdraft.py)
ROUTABLE = ("draft-model", "ngram", "corpus", "block", "mtp")  # what the domain router may pick
# What a feature drafter needs: the lean forward's hidden states and chain verification (greedy or sampled:
# its drafts are deterministic, so rejection sampling runs with a one-hot q).
FEATURE_NEEDS = {"method": "sd", "lean_forward": True, "verify": "chain", "dcut": False}
# What tree and two-level verification need: greedy, on the lean forward, with a draft model.
# Tree and two-level verification: greedy, with a draft model (which grows the tree on the lean forward). The
# target verifies on the lean forward (a tree mask), or on the HF path when it has recurrent layers (one batch
# row per branch, decoder/runners.py); decoder/capabilities.py decides which a model allows.
TREE_NEEDS = {"method": "sd", "drafter": "draft-model", "cuda_graphs": False, "temperature": 0.0}
DTYPES = ("bfloat16", "float32", "float16")
# mechanisms onednn-matmul and bf16w-matmul: whose kernels the lean forward's matmuls run
MATMUL_BACKENDS = ("torch", "onednn", "bf16w")
VERIFY_MODES = ("chain", "tree", "two-level")
MAX_TREE_NODES = 256  # nodes one tree verify may carry (the lean KV buffer and the mask grow with it)
MAX_NEW_TOKENS = 65536  # per request; a model's own position limit (max_position_embeddings) is usually lower


def parse_tree_shape(shape: str) -> tuple[int, ...] | None:
    """`"dynamic"` -> None; `"4,2,1"` -> (4, 2, 1): children per node at each depth of a static tree.

    Raises ValueError naming the bad part; DecodeConfig.validate turns it into a ConfigError.
    """
    if shape == "dynamic":
        return None
    try:
        widths = tuple(int(p) for p in shape.split(","))
    except ValueError:
        raise ValueError("use 'dynamic' or comma-separated children per depth, e.g. '4,2,1,1'") from None
    if not widths or not all(1 <= w <= 16 for w in widths) or len(widths) > 16:
        raise ValueError("each depth needs 1 to 16 children, at most 16 depths, e.g. '4,2,1,1'")
    return widths


def parse_load_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """`""` -> (); `"1:4,8:2,16:0"` -> ((1, 4), (8, 2), (16, 0)): from each batch size on (live requests
    in one step), the draft length to use until the next entry; 0 = no speculation (a plain AR step).

    Raises ValueError naming the bad part; DecodeConfig.validate turns it into a ConfigError.
    """
    if not text.strip():
        return ()
    out = []
    for part in text.split(","):
        try:
            b, k = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not BATCH:DRAFT_LEN; write e.g. '1:4,8:2,16:0'") from None
        if not 1 <= b <= 4096 or not 0 <= k <= 32:
            raise ValueError(f"{part.strip()!r}: batch sizes run 1 to 4096, draft lengths 0 to 32")
        out.append((b, k))
    if [b for b, _ in out] != sorted({b for b, _ in out}) or out[0][0] != 1:
        raise ValueError("batch sizes must rise strictly and start at 1, e.g. '1:4,8:2,16:0'")
    return tuple(out)


def scheduled_draft_len(cfg: DecodeConfig, live: int) -> int | None:
    """The load schedule's draft length for a step over `live` requests; None without a schedule."""
    sched = parse_load_schedule(cfg.load_schedule)
    if not sched:
        return None
    return next(k for b, k in reversed(sched) if b <= max(1, live))


SCHEDULE_MIN_GAIN = 1.03  # a draft length replaces AR steps only where its runs are this much faster than AR's


def choose_draft_len(rates: dict[int, float], min_gain: float = SCHEDULE_MIN_GAIN) -> int:
    """The fastest draft length of `rates` (tokens/s per length, 0 = AR steps), a speculative one only when it
    beats AR by `min_gain`: where they are close, AR steps are the safe side."""
    best = max(rates, key=rates.get)
    return 0 if best != 0 and 0 in rates and rates[best] < min_gain * rates[0] else best


def entry_starts(reach: dict[int, int]) -> dict[int, int]:
    """Where each batch size's load-schedule entry starts, in live requests (what the engine looks it up by).
    reach[b]: the most live requests b's runs had in a step, below b when requests end at their first token.
    b's entry starts at the first live count its runs reach and a smaller batch size's do not; a batch size
    that reaches none (its runs were a smaller one's) gets no entry. {1: 1, 4: 4, 8: 8, 16: 10, 32: 10} ->
    {1: 1, 4: 2, 8: 5, 16: 9}; the smallest batch size's entry starts at 1."""
    out, seen = {}, 0
    for b in sorted(reach):
        if not out or reach[b] > seen:
            out[b] = seen + 1 if out else 1
            seen = max(seen, reach[b])
    return out


def schedule_text(entries: dict[int, int]) -> str:
    """{1: 6, 2: 6, 5: 8, 9: 0} -> '1:6,5:8,9:0' (an entry only where the length changes)."""
    out, last = [], None
    for first, k in sorted(entries.items()):
        if k != last:
            out.append(f"{first}:{k}")
            last = k
    return ",".join(out)


def static_tree_nodes(widths: tuple[int, ...]) -> int:
    """Nodes (root excluded) of a static tree with `widths` children per node at each depth."""
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
    return total


def verify_width(cfg: DecodeConfig | Mapping) -> int:
    """Positions one target verify forward scores under `cfg` (1 for AR): the width the ceiling, the gaps
    and the noise floor are computed at. `cfg` may be a raw [decode] table (a candidate's, keys this schema
    does not know included): a missing or malformed value reads as DecodeConfig's default."""
    default = DecodeConfig.__dataclass_fields__

    def get(key: str, kind: type):
        v = cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)
        return v if isinstance(v, kind) and not (kind is int and isinstance(v, bool)) else default[key].default

    if get("method", str) == "ar":
        return 1
    k = max(0, min(get("draft_len", int), 64))
    if get("verify", str) == "tree":
        try:
            widths = parse_tree_shape(get("tree_shape", str))
        except ValueError:
            widths = None
        nodes = static_tree_nodes(widths) if widths is not None else get("tree_budget", int)
        return 1 + max(1, min(nodes, MAX_TREE_NODES))
    if get("verify", str) == "two-level":
        return 1 + k * (1 + max(0, min(get("two_level_alts", int), 8)))
    if get("drafter", str) == "mtp":
        return 1 + k * (1 + max(0, min(get("mtp_tree_alts", int), 8)))
    if get("drafter", str) == "corpus":  # at most one branch per alternative, never deeper than the chain
        alts = max(0, min(get("corpus_tree_alts", int), k))
        return 1 + k + sum(min(CORPUS_BRANCH_LEN, k - j) for j in range(alts))
    return 1 + k


class ConfigError(ValueError):
    """A config value a user wrote is invalid; the message names the key, the value and the fix."""


def read_table(text: str) -> dict:
    """The [decode] table of a config file as plain TOML values, every key kept (a system's own knobs
    included: the workbench passes keys it does not know through to the system's code)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"decode config: not valid TOML ({e})") from None
    table = data.get("decode", data)
    if not isinstance(table, dict):
        raise ConfigError("decode config: [decode] must be a table of keys")
    return table


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):  # a JSON string is a valid TOML basic string: quotes, backslashes, newlines escaped
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"decode config: value {v!r} ({type(v).__name__}) cannot be written as a TOML scalar")


def dump_table(table: dict, schema: type | None = None) -> str:
    """The [decode] TOML text of `table`: the keys of `schema` (a config dataclass; default DecodeConfig) in its
    order, then any others sorted."""
    order = {f.name: i for i, f in enumerate(fields(schema or DecodeConfig))}
    keys = sorted(table, key=lambda k: (k not in order, order.get(k, 0), k))
    return "\n".join(["[decode]", *(f"{k} = {_toml_value(table[k])}" for k in keys)]) + "\n"


class ConfigTable:
    """What a config dataclass shares (DecodeConfig; decoder/engines/llamacpp_config.py's LlamaCppConfig): read from
    a [decode] table key by key, each value checked against its default's type, written back as TOML."""

    LABEL = "decode config"  # how its errors name it

    def to_toml(self) -> str:
        return dump_table(asdict(self), type(self))

    @classmethod
    def from_table(cls, table: dict, known_only: bool = False) -> Self:
        """A config from a [decode] table. `known_only` drops keys this schema does not know (a newer
        system's knobs) instead of refusing them: for readers that need only the keys they know."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(table) - set(known))
        if unknown and not known_only:
            raise ConfigError(f"{cls.LABEL}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        default = cls()
        kwargs = {}
        for k, v in table.items():
            if k not in known:
                continue
            want = getattr(default, k)
            if isinstance(want, float) and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if type(v) is not type(want):
                raise ConfigError(f"{cls.LABEL}: {k} = {v!r} should be of type {type(want).__name__}")
            kwargs[k] = v
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, text: str, known_only: bool = False) -> Self:
        return cls.from_table(read_table(text), known_only)

    @classmethod
    def load(cls, path: Path) -> Self:
        return cls.from_toml(Path(path).read_text())

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_toml())

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class DecodeConfig(ConfigTable):
    method: str = "sd"  # "ar" (target alone) or "sd" (chain speculative decoding)
    drafter: str = "draft-model"  # see DRAFTERS: a draft model, lookups (ngram, corpus) or feature drafters
    draft_len: int = 3  # k: tokens drafted per step (an n-gram match may give fewer)
    ngram_max: int = 4  # longest suffix the n-gram drafter tries to match
    ngram_min: int = 1  # shortest suffix it accepts as a match
    temperature: float = 0.0  # 0 = greedy; > 0 = lossless rejection sampling
    top_p: float = 1.0  # kept at 1.0: the speculative sampler is exact for the tempered distribution only
    seed: int = 0
    max_new_tokens: int = 128
    stop_at_eos: bool = True
    lean_forward: bool = False  # mechanism lean_forward (host-overhead): fused, preallocated-KV forward
    # Mechanism transposed-matmul: lean forward calls of up to this many rows multiply by a transposed copy of each
    # weight (x @ W^T; 0 = off). Some CPU BLAS builds run few-row f32 matmuls faster that way; costs a second copy.
    matmul_t_rows: int = 0
    # Mechanism onednn-matmul: "onednn" = the lean forward's matmuls on weights packed once for oneDNN's linear
    # (CPU; nearly flat cost from 1 to 16 rows where float32 F.linear is not). Stock "torch" = F.linear.
    matmul_backend: str = "torch"
    # Mechanism fused-mlp: lean forward calls of at least this many rows (a prefill) run the SiLU MLP as two oneDNN
    # matmuls with the activation and the product fused into them (0 = off; needs matmul_backend = "onednn").
    fused_mlp_rows: int = 0
    # Mechanism bf16w-fused-layer: with matmul_backend = "bf16w", a Llama-style layer's work around attention at a
    # step's few rows (up to 64) as two kernel calls instead of ~25 torch ops (kernels/cpu_bf16w.c).
    fused_layer: bool = False
    # Mechanism bf16w-matmul: calls of up to this many rows run on the bf16w kernel, more rows on F.linear (1-64).
    # Where torch's own matmuls are fast at a verify's rows (a bfloat16 deployment on a CPU with AVX512-BF16 dot
    # products, or AMX) the kernel pays only at the fewest rows.
    bf16w_rows: int = 64
    cuda_graphs: bool = False  # mechanism cuda-graphs: static bucketed steps (decoder/lean.py), captured on CUDA
    weight_format: str = "bf16"  # mechanism w12-weights: "w12" swaps the target's linears (kernels/w12.py)
    # Batching mechanisms (decoder/batch.py; used by the batched engine only, all off in stock).
    ragged_verify: bool = False  # mechanism ragged-verify: forwards compute real rows only, no padded rectangle
    load_aware_draft: bool = False  # mechanism load-aware-drafting: per-request k from batch load and acceptance
    load_aware_fixed_rows: int = 64  # its cost model: a forward's fixed cost in target rows (weights read, overhead)
    continuous_batching: bool = False  # mechanism continuous-batching: finished requests leave, new ones join
    # Mechanism load-schedule: "1:4,8:2,16:0" = draft length per load (live requests in a step; 0 = AR step).
    load_schedule: str = ""
    # Mechanisms tree-verify and two-level-verify (decoder/tree.py), d-cut (decoder/dcut.py); off in stock.
    verify: str = "chain"  # "chain" (stock), "tree" (one forward over a draft tree), "two-level"
    tree_shape: str = "dynamic"  # "dynamic" (EAGLE-2 expansion by cumulative confidence) or "4,2,1,1"
    tree_topk: int = 4  # dynamic tree: children per expanded node and nodes expanded per depth
    tree_depth: int = 3  # dynamic tree: depth (drafter forwards per step)
    tree_budget: int = 12  # dynamic tree: nodes the target verifies per step (root excluded)
    two_level_alts: int = 3  # two-level: drafter alternatives held per chain position (chain length = draft_len)
    dcut: bool = False  # cut the draft where the product of drafter top-1 probs < dcut_threshold (cap draft_len)
    dcut_threshold: float = 0.02  # the best measured on the demo (README), with draft_len = 6
    # Mechanism domain-routing (drafter = "routed"): the drafter each domain's requests get.
    # Mechanism draft-vocab: the MTP heads score only the draft_vocab most frequent tokens (0 = the full head).
    draft_vocab: int = 0
    # Mechanism mtp-tree: each MTP head's next mtp_tree_alts tokens hang as leaves beside its top-1 chain node (a
    # comb tree, as two-level verification's), verified in the same forward (0 = a chain).
    mtp_tree_alts: int = 0
    # Mechanism corpus-tree: beside each of the corpus chain's first corpus_tree_alts nodes, a branch of
    # CORPUS_BRANCH_LEN tokens: the datastore's continuation under a shorter context where it differs from the
    # chain's token, then the corpus's token after it; verified in the same forward (0 = a chain).
    corpus_tree_alts: int = 0
    # Mechanism load-tree: the corpus or MTP tree only in steps over at most tree_max_live live requests; above, the
    # same drafter's chain (0 = a tree at every load). At B = 1 a tree's extra rows are nearly free on this CPU; in a
    # batch of 8 they cost (session 31's loop: a corpus tree 1.60x at B = 1 and 0.96x at B = 8 over its chain).
    tree_max_live: int = 0
    route_code: str = "mtp"  # the demo's measured best for both domains (README: feature drafters)
    route_prose: str = "mtp"
    dtype: str = "bfloat16"
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"decode config: {key} = {getattr(self, key)!r} is invalid: {why}")

        for f in fields(self):  # nan passes every comparison below, inf every lower bound
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise bad(f.name, "use a finite number")
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
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise bad("max_new_tokens", f"use 1 to {MAX_NEW_TOKENS} (and fewer than the target's positions)")
        if self.cuda_graphs and not self.lean_forward:
            raise bad("cuda_graphs", "the static step is built on the lean forward; set lean_forward = true")
        if not 0 <= self.matmul_t_rows <= 16:
            raise bad("matmul_t_rows", "use 0 (off) to 16 rows")
        if self.matmul_t_rows and not self.lean_forward:
            raise bad("matmul_t_rows", "it changes the lean forward's matmuls; set lean_forward = true or use 0")
        if self.matmul_backend not in MATMUL_BACKENDS:
            raise bad("matmul_backend", f"choose one of {', '.join(MATMUL_BACKENDS)}")
        if self.matmul_backend != "torch" and not self.lean_forward:
            raise bad("matmul_backend", "it changes the lean forward's matmuls; set lean_forward = true or use "
                                        "\"torch\"")
        if self.matmul_backend == "onednn" and self.device != "cpu":
            raise bad("matmul_backend", "oneDNN runs on the CPU; use \"torch\" on " + repr(self.device))
        if self.matmul_backend == "bf16w" and self.device != "cpu":
            raise bad("matmul_backend", "the bf16w kernel runs on the CPU; use \"torch\" on " + repr(self.device))
        if not 0 <= self.fused_mlp_rows <= 65536:
            raise bad("fused_mlp_rows", "use 0 (off) or the fewest rows a fused call takes, up to 65536")
        if not 1 <= self.bf16w_rows <= 64:
            raise bad("bf16w_rows", "use 1 to 64: the most rows a call runs on the bf16w kernel")
        if self.bf16w_rows != 64 and self.matmul_backend != "bf16w":
            raise bad("bf16w_rows", "it limits the bf16w kernel; set matmul_backend = \"bf16w\" or use 64")
        if self.fused_layer and self.matmul_backend != "bf16w":
            raise bad("fused_layer", "it runs on the bf16w kernel; set matmul_backend = \"bf16w\" or use false")
        if self.fused_mlp_rows and self.matmul_backend != "onednn":
            raise bad("fused_mlp_rows", "it fuses into oneDNN's matmuls; set matmul_backend = \"onednn\" or use 0")
        if self.weight_format not in ("bf16", "w12"):
            raise bad("weight_format", "choose bf16 or w12")
        if self.weight_format == "w12" and self.lean_forward:
            raise bad("weight_format", "w12 does not combine with lean_forward yet; turn one off")
        if not 1 <= self.load_aware_fixed_rows <= 4096:
            raise bad("load_aware_fixed_rows", "use 1 to 4096 (target rows one forward's fixed cost is worth)")
        if self.load_aware_draft and self.method != "sd":
            raise bad("load_aware_draft", "it chooses draft lengths; set method = \"sd\" or turn it off")
        try:
            parse_load_schedule(self.load_schedule)
        except ValueError as e:
            raise bad("load_schedule", str(e)) from None
        if self.verify not in VERIFY_MODES:
            raise bad("verify", f"choose one of {', '.join(VERIFY_MODES)}")
        try:
            widths = parse_tree_shape(self.tree_shape)
        except ValueError as e:
            raise bad("tree_shape", str(e)) from None
        if widths is not None and static_tree_nodes(widths) > MAX_TREE_NODES:
            raise bad("tree_shape", f"{static_tree_nodes(widths)} nodes exceed {MAX_TREE_NODES}; use fewer children")
        if not 1 <= self.tree_topk <= 16:
            raise bad("tree_topk", "use 1 to 16")
        if not 1 <= self.tree_depth <= 16:
            raise bad("tree_depth", "use 1 to 16")
        if not 1 <= self.tree_budget <= MAX_TREE_NODES:
            raise bad("tree_budget", f"use 1 to {MAX_TREE_NODES} nodes")
        if not 1 <= self.two_level_alts <= 8:
            raise bad("two_level_alts", "use 1 to 8")
        if not 0.0 < self.dcut_threshold < 1.0:
            raise bad("dcut_threshold", "use a probability strictly between 0 and 1")
        def require(needs: dict, key: str, why: str) -> None:
            for k, want in needs.items():
                if getattr(self, k) != want:
                    raise bad(key, why.format(k=k, want=want))

        if self.verify != "chain":
            require(TREE_NEEDS, "verify", f"{self.verify} verification needs {{k}} = {{want!r}} (it runs greedy "
                                          f"with a draft model); set it or use verify = 'chain'")
        if self.dcut:
            if self.drafter != "draft-model":
                raise bad("dcut", "D-cut reads the draft model's probabilities; set drafter = 'draft-model'")
            if self.verify != "chain":
                raise bad("dcut", "D-cut cuts a chain draft; use verify = 'chain' (trees already expand by confidence)")
        if self.draft_vocab and not 64 <= self.draft_vocab <= 262144:
            raise bad("draft_vocab", "use 0 (the full head) or 64 to 262144 tokens")
        if self.draft_vocab and self.drafter not in ("mtp", "routed", "draft-model"):
            raise bad("draft_vocab", "only the MTP heads and the draft model have a pruned head; set drafter = "
                                     "'mtp' or 'draft-model', or draft_vocab = 0")
        if self.draft_vocab and self.drafter == "draft-model" and not self.lean_forward:
            raise bad("draft_vocab", "the draft model's pruned head is on its lean forward; set lean_forward = true "
                                     "or draft_vocab = 0")
        if not 0 <= self.mtp_tree_alts <= 8:
            raise bad("mtp_tree_alts", "use 0 (a chain) to 8 alternatives per head")
        if self.mtp_tree_alts and self.drafter != "mtp":
            raise bad("mtp_tree_alts", "only the MTP heads draft a comb tree; set drafter = 'mtp' or use 0")
        if self.mtp_tree_alts and (self.temperature != 0 or self.cuda_graphs):
            raise bad("mtp_tree_alts", "a tree verifies greedily on the eager lean forward: set temperature = 0 "
                                       "and cuda_graphs = false, or use 0")
        if not 0 <= self.corpus_tree_alts <= 8:
            raise bad("corpus_tree_alts", "use 0 (a chain) to 8 branch points")
        if self.corpus_tree_alts and self.drafter != "corpus":
            raise bad("corpus_tree_alts", "only the corpus drafter hangs datastore branches; set drafter = 'corpus' "
                                          "or use 0")
        if self.corpus_tree_alts and (self.temperature != 0 or self.cuda_graphs or not self.lean_forward):
            raise bad("corpus_tree_alts", "a tree verifies greedily on the eager lean forward: set temperature = 0, "
                                          "cuda_graphs = false and lean_forward = true, or use 0")
        if not 0 <= self.tree_max_live <= 4096:
            raise bad("tree_max_live", "use 0 (a tree at every load) or 1 to 4096 live requests")
        if self.tree_max_live and not (self.corpus_tree_alts or self.mtp_tree_alts):
            raise bad("tree_max_live", "it switches the corpus or MTP tree to a chain above that load; set "
                                       "corpus_tree_alts or mtp_tree_alts, or use 0")
        for key in ("route_code", "route_prose"):
            if getattr(self, key) not in ROUTABLE:
                raise bad(key, f"choose one of {', '.join(ROUTABLE)}")
        if self.drafter in FEATURE_DRAFTERS and self.method == "sd":
            require(FEATURE_NEEDS, "drafter", f"the {self.drafter} drafter reads the target's hidden states from "
                                              f"the lean forward and verifies a chain: it needs {{k}} = {{want!r}}; "
                                              f"set it or choose drafter = 'draft-model'")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"choose one of {', '.join(DTYPES)}")


