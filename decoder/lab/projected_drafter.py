"""The SmolLM2 drafter's model: a small Llama on the target's projected embedding, its weights file, and its
two deployable forms (a Hugging Face directory, a llama.cpp GGUF). The recipe that trains it is
`decoder/lab/smollm2_drafter.py`; `decoder/engines/smollm2.py` materialises the forms from the committed
weights. This module imports nothing of either, so the light deployment module can reach it lazily."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaModel

from decoder.engines.gguf_write import write_tensors

ROPE_THETA = 10000.0
RMS_EPS = 1e-5


@dataclass
class SmolDrafterSpec:
    """Everything that determines the SmolLM2 drafter (written beside its weights)."""

    seed: int = 0
    instructions: int = 2400
    code_share: float = 0.6
    answer_tokens: int = 128  # the bench's answer length
    val_rows: int = 160
    hidden_size: int = 192
    num_layers: int = 2
    intermediate_size: int = 768
    num_heads: int = 3
    num_kv_heads: int = 1
    steps: int = 500
    batch_size: int = 16
    lr: float = 2e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.05
    checkpoint_every: int = 20
    stage2_steps: int = 700  # a second schedule from stage 1's weights (0: none)
    stage2_lr: float = 1.5e-3
    server_parallel: int = 16
    threads: int = 2



def target_embedding(gguf_path: Path) -> torch.Tensor:
    """SmolLM2's token embedding (vocab x 576, float32), dequantised from the deployment's GGUF."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")))


class ProjectedDrafter(torch.nn.Module):
    """A small Llama whose tied embedding is the target's embedding E projected: W = E @ proj."""

    def __init__(self, spec: SmolDrafterSpec, embedding: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("embedding", embedding, persistent=False)
        self.proj = torch.nn.Parameter(torch.zeros(embedding.shape[1], spec.hidden_size))
        self.model = LlamaModel(_llama_config(spec, vocab_size=1))  # its 1-row embedding is unused

    def init_projection(self) -> None:
        """P = E's top right singular vectors: E @ P keeps E's leading principal components."""
        _, _, vh = torch.linalg.svd(self.embedding, full_matrices=False)
        with torch.no_grad():
            self.proj.copy_(vh[: self.proj.shape[1]].T)

    def weight(self) -> torch.Tensor:
        return self.embedding @ self.proj

    def forward(self, ids: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
        """Logits at every position, or only at the positions where the mask `where` is true (flattened)."""
        w = self.weight()
        h = self.model(inputs_embeds=F.embedding(ids, w), use_cache=False).last_hidden_state
        if where is not None:
            h = h[where]
        return h @ w.T.to(h.dtype)


def _llama_config(spec: SmolDrafterSpec, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                       intermediate_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
                       num_key_value_heads=spec.num_kv_heads, max_position_embeddings=2048, rope_theta=ROPE_THETA,
                       rms_norm_eps=RMS_EPS, tie_word_embeddings=True, attn_implementation="sdpa",
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)



def save_drafter(model: ProjectedDrafter, spec: SmolDrafterSpec, out: Path, recipe: dict,
                 weights: str = "drafter.safetensors") -> None:
    """The trainable weights (projection and layers; not the target's embedding) and the recipe, atomically."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != "model.embed_tokens.weight"}
    tmp = out / f".{weights}.tmp"
    save_file(state, str(tmp), metadata={"spec": json.dumps(asdict(spec))})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / weights)
    tmp = out / ".recipe.json.tmp"
    tmp.write_text(json.dumps(recipe, indent=2) + "\n")
    os.replace(tmp, out / "recipe.json")


def load_weights(weights: Path, embedding: torch.Tensor) -> ProjectedDrafter:
    """A drafter from its weights file (projection and layers, its spec in the metadata) and the target's
    embedding. ValueError (one line) when the file does not match its own spec."""
    with safe_open(str(weights), "pt") as f:
        spec = SmolDrafterSpec(**json.loads(f.metadata()["spec"]))
    model = ProjectedDrafter(spec, embedding)
    state = {k: v.float() for k, v in load_file(str(weights)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "model.embed_tokens.weight"]:
        raise ValueError(f"{weights} does not match its spec (missing {missing}, unexpected {unexpected}); "
                         f"retrain with `specpilot train smollm2-drafter`")
    return model.eval()


def write_hf_dir(model: ProjectedDrafter, tokenizer_dir: Path, dest: Path) -> None:
    """The drafter as a Hugging Face Llama directory (float32; embed_tokens = lm_head = E @ P) with the target's
    tokenizer files: what our engine loads as the smollm2 deployment's draft model."""
    cfg = _llama_config(SmolDrafterSpec(hidden_size=model.model.config.hidden_size,
                                        num_layers=model.model.config.num_hidden_layers,
                                        intermediate_size=model.model.config.intermediate_size,
                                        num_heads=model.model.config.num_attention_heads,
                                        num_kv_heads=model.model.config.num_key_value_heads),
                        vocab_size=model.embedding.shape[0])
    tcfg = json.loads((tokenizer_dir / "config.json").read_text())
    cfg.bos_token_id, cfg.eos_token_id = tcfg.get("bos_token_id"), tcfg.get("eos_token_id")
    hf = LlamaForCausalLM(cfg)
    state = {f"model.{k}": v for k, v in model.model.state_dict().items() if k != "embed_tokens.weight"}
    state["model.embed_tokens.weight"] = model.weight().detach()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"drafter state does not fit a Llama: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    dest.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(dest))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, dest / name)



# ---------------------------------------------------------------- the drafter as a GGUF for llama.cpp

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half Q/K rows to GGML's interleaved rope order (as llama.cpp's converter does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: ProjectedDrafter, target_gguf: Path, dest: Path) -> None:
    """The drafter as a llama GGUF (2-D weights Q8_0, norms f32) with the target's tokenizer keys copied."""
    import gguf

    cfg = model.model.config
    q8, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    reader = gguf.GGUFReader(str(target_gguf))
    writer = gguf.GGUFWriter(str(dest), arch="llama", endianess=reader.endianess)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_name("SmolLM2-135M-Instruct drafter (SpecPilot)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(model.embedding.shape[0])
    sd = {k: v.detach().float().numpy() for k, v in model.model.state_dict().items()}
    tensors = [("token_embd.weight", model.weight().detach().float().numpy()),
               ("output_norm.weight", sd["norm.weight"])]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        tensors += [
            (f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"]),
            (f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads)),
            (f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads)),
            (f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"]),
            (f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"]),
            (f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]),
            (f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]),
            (f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"]),
            (f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"]),
        ]
    packed = []
    for name, data in tensors:
        data = np.ascontiguousarray(data, dtype=np.float32)
        packed.append((name, gguf.quants.quantize(data, q8), q8) if data.ndim == 2 else (name, data, f32))
    write_tensors(writer, packed)
