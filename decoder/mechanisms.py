"""The decoder's mechanism registry: what the tuner may switch on and tune, all off in stock.

Each entry names its DecodeConfig keys with their ranges, the gap family it closes (the cost
model's families), and when it applies. Stock is `DecodeConfig()` with every mechanism at its
`stock` value; a candidate is stock plus changes to these keys only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decoder.config import FEATURE_NEEDS, TREE_NEEDS, DecodeConfig

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


REGISTRY: dict[str, Mechanism] = {m.name: m for m in (
    Mechanism(
        name="speculative-draft-model", family="drafting",
        keys={"method": ("ar", "sd"), "drafter": ("draft-model",), "draft_len": tuple(range(1, 9))},
        stock={"method": "sd", "drafter": "draft-model", "draft_len": 3},
        applies="a draft model sharing the target's tokenizer exists",
        summary="chain SD with a small draft model; draft_len trades drafting time against tau",
    ),
    Mechanism(
        name="speculative-ngram", family="drafting",
        keys={"drafter": ("ngram",), "draft_len": (2, 4, 6, 8, 12, 16), "ngram_max": (2, 3, 4, 6),
              "ngram_min": (1, 2, 3)},
        stock={"drafter": "draft-model"},
        applies="outputs repeat spans of the prompt or of themselves (code, extraction, edits)",
        summary="prompt-lookup drafting from an incremental n-gram index: no drafter forward at all",
        requires={"method": "sd"},
    ),
    Mechanism(
        name="w12-weights", family="weights",
        keys={"weight_format": ("bf16", "w12")},
        stock={"weight_format": "bf16"},
        applies="bf16 target on a GPU (Triton kernel); lossless everywhere, slower on CPU (reference unpack)",
        summary="lossless 12-bit weights (kernels/w12.py): 25% fewer weight bytes per decode step",
        requires={"lean_forward": False},  # the lean forward reads fused bf16 weights
        devices=("cuda",),
    ),
    Mechanism(
        name="lean-forward", family="host-overhead",
        keys={"lean_forward": (False, True)},
        stock={"lean_forward": False},
        applies="Llama-family target/drafter (no biases) where per-forward framework overhead is large",
        summary="fused QKV and gate/up projections, preallocated KV cache with rollback by length "
                "(decoder/lean.py); logits bit-identical to the HF path on the demo",
    ),
    Mechanism(
        name="cuda-graphs", family="host-overhead",
        keys={"cuda_graphs": (False, True)},
        stock={"cuda_graphs": False},
        applies="CUDA targets where kernel launches dominate a decode step (small models, batch 1)",
        summary="steps padded to verify-width buckets with tensor positions and masks (StaticLeanLM); "
                "each bucket captured once as a CUDA graph and replayed; eager on the CPU",
        requires={"lean_forward": True},
        devices=("cuda",),
    ),
    Mechanism(
        name="ragged-verify", family="batching",
        keys={"ragged_verify": (False, True)},
        stock={"ragged_verify": False},
        applies="batched decoding where requests feed different numbers of tokens (ragged drafts, finished rows)",
        summary="batched forwards pack only real rows of all requests into one [sum q_i] token batch for the "
                "projections and MLP; attention per request by mask and positions (decoder/batch.py)",
    ),
    Mechanism(
        name="load-aware-drafting", family="batching",
        keys={"load_aware_draft": (False, True), "load_aware_fixed_rows": (8, 16, 32, 64, 128, 256)},
        stock={"load_aware_draft": False, "load_aware_fixed_rows": 64},
        applies="batched SD where a full batch makes every verified row cost target compute",
        summary="per-request draft length from the batch size and each request's running acceptance: a "
                "draft token is kept while its expected yield beats the step's tokens per row of cost",
        requires={"method": "sd"},
    ),
    Mechanism(
        name="continuous-batching", family="batching",
        keys={"continuous_batching": (False, True)},
        stock={"continuous_batching": False},
        applies="serving with requests of uneven length or arriving over time",
        summary="finished requests leave the batch and waiting ones join between steps (their prefill is "
                "one forward), so the batch never waits for its slowest request",
    ),
    Mechanism(
        name="load-schedule", family="batching",
        keys={"load_schedule": ("", "1:4,8:2,16:0", "1:3,4:2,8:1,16:0", "1:4,4:1,8:0", "1:3,8:0", "1:4,2:2,4:0")},
        stock={"load_schedule": ""},
        applies="batched serving where speculation pays at low load and costs at high load (every verified "
                "row costs target compute once the batch fills the hardware)",
        summary="draft length per load (live requests in a step; 0 = a plain AR step), read by the single-request "
                "loop at B = 1 and the batched engine every step; the tuner measures each batch size of the "
                "deployment's load and writes the best length per point",
        requires={"method": "sd"},
    ),
    Mechanism(
        name="draft-vocab", family="drafting",
        keys={"draft_vocab": (0, 512, 1024, 2048)},
        stock={"draft_vocab": 0},
        applies="MTP heads whose LM-head matmul over the full vocabulary is most of their drafting cost (a small "
                "hidden size against a large vocabulary)",
        summary="the heads score only the most frequent tokens of the target's corpus (a ranking made by "
                "`specpilot train drafter --kind vocab`); lossless, since the target verifies every draft",
        requires={"method": "sd", "drafter": "mtp", "lean_forward": True},
    ),
    Mechanism(
        name="tree-verify", family="acceptance",
        keys={"verify": ("chain", "tree"), "tree_shape": ("dynamic", "2,2,1,1", "3,2,1,1", "4,2,1,1", "2,2,2,1,1"),
              "tree_topk": (2, 3, 4, 6, 8), "tree_depth": (3, 4, 5, 6, 8), "tree_budget": (8, 12, 16, 24, 32, 48)},
        stock={"verify": "chain"},
        applies="a draft model whose top-1 misses often but whose top-k holds the target's token; the target's "
                "step cost grows slowly with verify width (batch 1, memory- or overhead-bound)",
        summary="one target forward over a draft tree (static shape or EAGLE-2 dynamic expansion under a node "
                "budget) with an ancestor-only mask; the accepted path's KV compacted in place (decoder/tree.py)",
        requires=TREE_MECHANISM_NEEDS,
    ),
    Mechanism(
        name="two-level-verify", family="acceptance",
        keys={"verify": ("chain", "two-level"), "two_level_alts": (1, 2, 3, 4), "draft_len": tuple(range(1, 9))},
        stock={"verify": "chain"},
        applies="the drafter's top-1 misses often but its top few hold the target's token; the target's step "
                "cost is flat in verify width",
        summary="level 1 the drafter's chain, level 2 its next-best tokens beside every chain node as leaves, "
                "one target forward; no drafter forward beyond the chain's (decoder/tree.py)",
        requires=TREE_MECHANISM_NEEDS,
    ),
    Mechanism(
        name="d-cut", family="drafting",
        keys={"dcut": (False, True), "dcut_threshold": (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7),
              "draft_len": tuple(range(1, 13))},
        stock={"dcut": False},
        applies="a draft model whose confidence predicts acceptance; spans of very different difficulty",
        summary="cut each draft where the running product of drafter top-1 probabilities falls below a "
                "threshold; under batching a verify budget ranked by that product (decoder/dcut.py)",
        requires={"method": "sd", "drafter": "draft-model", "verify": "chain"},
    ),
    Mechanism(
        name="block-drafter", family="drafting",
        keys={"drafter": ("block",), "draft_len": tuple(range(2, 17))},
        stock={"drafter": "draft-model"},
        applies="the target has a trained block drafter (TARGET/drafters/block): long drafts where a draft "
                "model's per-token forwards cost too much (code, maths)",
        summary="parallel block drafter on the target's hidden states (DFlash-style): k tokens in one "
                "non-causal drafter forward, context KV of accepted positions only (decoder/featdraft.py)",
        requires=FEATURE_NEEDS,
    ),
    Mechanism(
        name="mtp-heads", family="drafting",
        keys={"drafter": ("mtp",), "draft_len": (2, 3, 4, 5, 6)},
        stock={"drafter": "draft-model"},
        applies="the target has trained MTP heads (TARGET/drafters/mtp): chat-like prose, short confident drafts",
        summary="k light residual heads on the target's final hidden state and next token, one batched "
                "matmul per step; no drafter model or cache at all (decoder/featdraft.py)",
        requires=FEATURE_NEEDS,
    ),
    Mechanism(
        name="domain-routing", family="drafting",
        keys={"drafter": ("routed",), "route_code": ("block", "mtp", "draft-model", "ngram"),
              "route_prose": ("mtp", "block", "draft-model", "ngram"), "draft_len": (3, 4, 6, 8)},
        stock={"drafter": "draft-model"},
        applies="mixed traffic (code and prose) where different domains want different drafters; the target "
                "has a router (TARGET/drafters/router.json)",
        summary="a bag-of-tokens code/prose router (~20 us) picks the drafter per request",
        requires=FEATURE_NEEDS,
    ),
)}


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
