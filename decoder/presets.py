"""Named decoding presets: the bench's methods as DecodeConfig overrides, run through the one loop.

A preset is a set of DecodeConfig keys over a base config (the bench's draft length, token budget,
dtype). `specpilot bench --methods sd-two-level` and a workspace whose system.toml holds the same keys
run the same code with the same settings, so they give the same tokens and the same tau (a test).
Where a preset leaves a key alone, DecodeConfig's default applies: the defaults of the tree, two-level
and D-cut keys are the best measured on the demo (README), the bench's values.
"""

from __future__ import annotations

import dataclasses

from decoder.config import DecodeConfig

NGRAM_DRAFT_LEN = 8  # `specpilot bench --ngram-draft-len` default: lookup drafts are cheap, go long
DCUT_MAX_LEN = 6  # sd-dcut's cap on a draft (the cut usually stops it earlier)
BLOCK_DRAFT_LEN = 8
MTP_DRAFT_LEN = 6
CORPUS_TREE_ALTS = 1  # sd-corpus-tree-fused: branch points (1 beat 2 and 4 on demo prose and code, README)
FUSED_MLP_ROWS = 128  # fused-mlp presets: calls of at least this many rows (measured on this CPU: 1.05x at 128 rows)

PRESETS: dict[str, dict] = {
    "ar": {"method": "ar"},
    "sd-draft-model": {},
    "sd-ngram": {"drafter": "ngram", "draft_len": NGRAM_DRAFT_LEN},
    # Mechanism lean_forward: the same methods on decoder/lean.py's forward.
    "ar-lean": {"method": "ar", "lean_forward": True},
    "sd-draft-model-lean": {"lean_forward": True},
    "sd-ngram-lean": {"drafter": "ngram", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True},
    # Mechanism transposed-matmul: the lean methods with x @ W^T at up to 3 rows (AR steps, drafter steps, k <= 2).
    "ar-lean-t": {"method": "ar", "lean_forward": True, "matmul_t_rows": 3},
    "sd-draft-model-lean-t": {"lean_forward": True, "matmul_t_rows": 3},
    "sd-ngram-lean-t": {"drafter": "ngram", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True, "matmul_t_rows": 3},
    # Mechanism onednn-matmul: the lean methods (and the MTP ones) with the matmuls on oneDNN's packed weights.
    "ar-lean-dnn": {"method": "ar", "lean_forward": True, "matmul_backend": "onednn"},
    "sd-draft-model-lean-dnn": {"lean_forward": True, "matmul_backend": "onednn"},
    # Mechanism draft-vocab on the draft model too: its LM head scores the target's 1024 most frequent tokens.
    "sd-draft-model-vocab-dnn": {"lean_forward": True, "matmul_backend": "onednn", "draft_vocab": 1024},
    "sd-ngram-lean-dnn": {"drafter": "ngram", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True,
                          "matmul_backend": "onednn"},
    # Mechanism corpus-drafter: prompt lookup backed by the target's corpus datastore (decoder/datastore.py).
    "sd-corpus-lean": {"drafter": "corpus", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True},
    "sd-corpus-lean-dnn": {"drafter": "corpus", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True,
                           "matmul_backend": "onednn"},
    # Mechanism bf16w-matmul: the lean methods with the weights held as bfloat16 and a CPU kernel multiplying them.
    "ar-lean-bf16w": {"method": "ar", "lean_forward": True, "matmul_backend": "bf16w"},
    "sd-corpus-lean-bf16w": {"drafter": "corpus", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True,
                             "matmul_backend": "bf16w"},
    "sd-corpus-tree-bf16w": {"drafter": "corpus", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True,
                             "matmul_backend": "bf16w", "corpus_tree_alts": CORPUS_TREE_ALTS},
    # Mechanism bf16w-fused-layer on top: a layer's work around attention as two kernel calls at a step's few rows.
    "ar-lean-layer": {"method": "ar", "lean_forward": True, "matmul_backend": "bf16w", "fused_layer": True},
    "sd-corpus-lean-layer": {"drafter": "corpus", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True,
                             "matmul_backend": "bf16w", "fused_layer": True},
    "sd-corpus-tree-layer": {"drafter": "corpus", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True,
                             "matmul_backend": "bf16w", "fused_layer": True, "corpus_tree_alts": CORPUS_TREE_ALTS},
    "sd-ngram-lean-layer": {"drafter": "ngram", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True,
                            "matmul_backend": "bf16w", "fused_layer": True},
    "sd-mtp-layer": {"lean_forward": True, "drafter": "mtp", "draft_len": MTP_DRAFT_LEN, "matmul_backend": "bf16w",
                     "fused_layer": True},
    # Mechanism fused-mlp on top of onednn-matmul: from FUSED_MLP_ROWS rows (a prefill), the MLP's SiLU and product
    # ride on oneDNN's matmuls.
    "ar-lean-fused": {"method": "ar", "lean_forward": True, "matmul_backend": "onednn",
                      "fused_mlp_rows": FUSED_MLP_ROWS},
    "sd-corpus-lean-fused": {"drafter": "corpus", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True,
                             "matmul_backend": "onednn", "fused_mlp_rows": FUSED_MLP_ROWS},
    # Mechanism corpus-tree on top: beside the chain's first CORPUS_TREE_ALTS nodes, a two-token datastore branch.
    "sd-corpus-tree-fused": {"drafter": "corpus", "draft_len": NGRAM_DRAFT_LEN, "lean_forward": True,
                             "matmul_backend": "onednn", "fused_mlp_rows": FUSED_MLP_ROWS,
                             "corpus_tree_alts": CORPUS_TREE_ALTS},
    # Mechanism weight_format = "w12".
    "ar-w12": {"method": "ar", "weight_format": "w12"},
    "sd-draft-model-w12": {"weight_format": "w12"},
    "sd-ngram-w12": {"drafter": "ngram", "draft_len": NGRAM_DRAFT_LEN, "weight_format": "w12"},
    # Mechanisms tree-verify, two-level-verify and d-cut.
    "sd-tree": {"lean_forward": True, "verify": "tree"},
    "sd-two-level": {"lean_forward": True, "verify": "two-level"},
    "sd-dcut": {"lean_forward": True, "dcut": True, "draft_len": DCUT_MAX_LEN},
    # The same verification on the HF path, for targets with recurrent layers (one batch row per branch).
    "sd-tree-hf": {"verify": "tree"},
    "sd-two-level-hf": {"verify": "two-level"},
    # Mechanisms block-drafter, mtp-heads and domain-routing.
    "sd-block": {"lean_forward": True, "drafter": "block", "draft_len": BLOCK_DRAFT_LEN},
    "sd-mtp": {"lean_forward": True, "drafter": "mtp", "draft_len": MTP_DRAFT_LEN},
    "sd-mtp-vocab": {"lean_forward": True, "drafter": "mtp", "draft_len": MTP_DRAFT_LEN, "draft_vocab": 1024},
    "sd-routed": {"lean_forward": True, "drafter": "routed", "draft_len": MTP_DRAFT_LEN},
    "sd-tree-dnn": {"lean_forward": True, "verify": "tree", "matmul_backend": "onednn"},
    "sd-two-level-dnn": {"lean_forward": True, "verify": "two-level", "matmul_backend": "onednn"},
    "sd-dcut-dnn": {"lean_forward": True, "dcut": True, "draft_len": DCUT_MAX_LEN, "matmul_backend": "onednn"},
    "sd-mtp-dnn": {"lean_forward": True, "drafter": "mtp", "draft_len": MTP_DRAFT_LEN, "matmul_backend": "onednn"},
    "sd-mtp-vocab-dnn": {"lean_forward": True, "drafter": "mtp", "draft_len": MTP_DRAFT_LEN, "draft_vocab": 1024,
                         "matmul_backend": "onednn"},
    # Mechanism mtp-tree on top: each head's next 2 tokens beside the chain.
    "sd-mtp-tree-dnn": {"lean_forward": True, "drafter": "mtp", "draft_len": MTP_DRAFT_LEN, "draft_vocab": 1024,
                        "mtp_tree_alts": 2, "matmul_backend": "onednn"},
}


def preset_config(name: str, base: DecodeConfig, **overrides: object) -> DecodeConfig:
    """The DecodeConfig of preset `name` over `base`, with `overrides` (flags) applied last."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return dataclasses.replace(base, **{**PRESETS[name], **overrides})
