"""The architecture matrix (#23): every decoding method on tiny random models of the architectures people
deploy either refuses in one line before any work or is lossless against Hugging Face greedy; none fails
silently. Recurrent and hybrid targets (Mamba2, Bamba, Jamba, Qwen3-Next, Falcon-H1, LFM2, Zamba2) decode
speculatively through the rollback cache (decoder/runners.py).

`python tests/test_archs.py` prints the matrix the README shows."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from decoder.capabilities import Unsupported, refusal
from decoder.config import DecodeConfig
from decoder.contract import near_tie
from decoder.generate import generate
from decoder.lab.bench import first_divergence, noise_floor, top2_margin
from decoder.presets import PRESETS, preset_config
from decoder.runners import RollbackCache, as_runner, crop_cache, recurrent_layers, rollback

V = 128
ATT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=V,
           max_position_embeddings=256)
ARCHS = {
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, **ATT),
    "mistral-sw": lambda: transformers.MistralConfig(num_hidden_layers=2, sliding_window=8, **ATT),
    "qwen2": lambda: transformers.Qwen2Config(num_hidden_layers=2, **ATT),
    "qwen3": lambda: transformers.Qwen3Config(num_hidden_layers=2, head_dim=16, **ATT),
    "gemma": lambda: transformers.GemmaConfig(num_hidden_layers=2, head_dim=16, **ATT),
    "gemma2": lambda: transformers.Gemma2Config(num_hidden_layers=2, head_dim=16, sliding_window=8, **ATT),
    "phi3": lambda: transformers.Phi3Config(num_hidden_layers=2, pad_token_id=0, **ATT),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                   intermediate_size=128, vocab_size=V),
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=256),
    "mixtral": lambda: transformers.MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                                  **ATT),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_hidden_layers=2, head_dim=16, num_experts=4,
                                                     num_experts_per_tok=2, moe_intermediate_size=32, **ATT),
    "mamba2": lambda: transformers.Mamba2Config(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_heads=8,
                                                head_dim=16, state_size=16, expand=2, n_groups=1, chunk_size=16),
    "bamba": lambda: transformers.BambaConfig(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8,
                                              mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
                                              mamba_chunk_size=16, mamba_expand=2, **ATT),
    "jamba": lambda: transformers.JambaConfig(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                              expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                                              mamba_d_state=8, mamba_dt_rank=8, **ATT),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        num_hidden_layers=4, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=2, **ATT),
    "falcon_h1": lambda: transformers.FalconH1Config(num_hidden_layers=2, head_dim=16, mamba_d_ssm=128,
                                                     mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                                                     mamba_chunk_size=16, **ATT),
    "lfm2": lambda: transformers.Lfm2Config(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                            **ATT),
}
# The chain and tree methods of the bench, on the HF path and on the lean forward (feature drafters are
# lean-forward proposers too: tests/test_featdraft.py and tests/test_lean_archs.py cover them).
METHODS = ("ar", "sd-draft-model", "sd-ngram", "ar-lean", "sd-draft-model-lean", "sd-ngram-lean", "sd-tree",
           "sd-two-level", "sd-dcut", "sd-tree-hf", "sd-two-level-hf")
BASE = DecodeConfig(max_new_tokens=24, dtype="float32", stop_at_eos=False, draft_len=3)


def _build(name: str, seed: int):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(ARCHS[name]()).float().eval()
    with torch.no_grad():  # sharper than the default init: fewer near ties in a random model's argmax
        model.get_output_embeddings().weight.mul_(8)
    return model


_CACHE: dict[str, tuple] = {}


def _case(name: str):
    """(target, drafter, prompt, HF greedy reference, noise floor) for one architecture, built once."""
    if name not in _CACHE:
        target = _build(name, 0)
        # The drafter is another random model of the same architecture: it is mostly wrong, so rollback (of the
        # target and, for a recurrent drafter, of the drafter) runs at almost every step.
        drafter = _build(name, 1)
        prompt = torch.randint(1, V, (20,), generator=torch.Generator().manual_seed(5)).tolist()
        with torch.inference_mode():
            out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=BASE.max_new_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
            ref = out[0, len(prompt):].tolist()
            floor = noise_floor(target, [(prompt, ref)], (2, 4))
        _CACHE[name] = (target, drafter, prompt, ref, floor)
    return _CACHE[name]


def run_cell(name: str, method: str) -> tuple[str, str]:
    """('refused', reason) | ('lossless', how) | ('WRONG', where) for one architecture and method."""
    target, drafter, prompt, ref, floor = _case(name)
    cfg = preset_config(method, BASE)
    if method.endswith("-hf"):  # HF-path trees grow on the drafter's lean forward: a Llama drafts for them
        drafter = _case("llama")[1]
    why = refusal(cfg, target.config, drafter.config)
    if why is not None:
        with pytest.raises(Unsupported) as e:  # generate refuses the same way, before any work
            generate(cfg, target, prompt, drafter)
        assert "\n" not in str(e.value) and str(e.value) == why
        return "refused", why
    with torch.inference_mode():
        g = generate(cfg, target, prompt, drafter)
        pos = first_divergence(g.tokens, ref)
        if pos is None:
            return "lossless", f"tau {g.stats.tau:.2f}"
        margin = top2_margin(target, prompt + ref[:pos])
    if near_tie(margin, floor):
        return "lossless", f"near tie at {pos} (margin {margin:.2g} < 2 x floor {floor:.2g})"
    return "WRONG", f"diverges at {pos} of {len(ref)} (margin {margin:.3g}, floor {floor:.2g})"


# The fast tier covers each kind once (dense, sliding window, q/k norm, MoE, Mamba2 hybrid, DeltaNet hybrid with
# experts); the rest of the matrix runs in `make test-slow`.
FAST = ("llama", "mistral-sw", "qwen3", "gemma2", "mixtral", "bamba", "qwen3_next")


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in ARCHS])
def test_every_method_refuses_in_one_line_or_is_lossless(name):
    for method in METHODS:
        verdict, how = run_cell(name, method)
        assert verdict != "WRONG", (name, method, how)
    if recurrent_layers(_case(name)[0].config):  # chain SD over a recurrent target ran, with rollback
        assert run_cell(name, "sd-draft-model")[0] == "lossless"


RECURRENT = tuple(n for n in ARCHS if n in ("mamba2", "bamba", "jamba", "qwen3_next", "falcon_h1", "lfm2"))


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_rollback_restores_the_state_and_refeeds_the_accepted_tokens(name):
    """Exact: after a step of 4 whose last 2 tokens were rejected, the cache continues bit for bit as one that
    saw the same chunks and never rolled back (the token matrix alone is a weak check on a random hybrid,
    whose argmax the embeddings dominate)."""
    target = _build(name, 0)
    runner = as_runner(target)
    ids = list(range(3, 23))
    with torch.inference_mode():
        cache = runner.new_cache()
        assert isinstance(cache, RollbackCache)
        runner.forward(torch.tensor(ids[:12]), cache)
        runner.forward(torch.tensor(ids[12:16]), cache)  # a verify step: saves the state at 12 first
        assert cache.saved_length() == 12 and cache.get_seq_length() == 16
        rollback(runner, cache, 14, ids)  # 2 of the step's 4 tokens kept: restore to 12, feed ids[12:14]
        assert cache.get_seq_length() == 14 and cache.saved_length() is None
        after = runner.forward(torch.tensor(ids[14:16]), cache)
        fresh = runner.new_cache()  # the same tokens in the same chunks, never rolled back
        runner.forward(torch.tensor(ids[:12]), fresh)
        runner.forward(torch.tensor(ids[12:14]), fresh)
        expect = runner.forward(torch.tensor(ids[14:16]), fresh)
    assert torch.equal(after, expect)
    with pytest.raises(TypeError, match="rollback"):
        crop_cache(cache, 3)


def test_bench_presets_are_the_matrix_methods():
    assert set(METHODS) <= set(PRESETS)


if __name__ == "__main__":  # the README's matrix
    print("| architecture | " + " | ".join(METHODS) + " |")
    print("|---" * (len(METHODS) + 1) + "|")
    notes: dict[str, int] = {}
    for arch in ARCHS:
        cells = []
        for m in METHODS:
            verdict, how = run_cell(arch, m)
            if verdict == "refused":
                cells.append(f"refused [{notes.setdefault(how, len(notes) + 1)}]")
            else:
                cells.append("ok" if verdict == "lossless" else "WRONG")
        print(f"| {arch} | " + " | ".join(cells) + " |")
        sys.stdout.flush()
    for how, i in notes.items():
        print(f"[{i}] {how}")


def test_the_tuner_proposes_only_what_a_hybrid_target_can_run(tmp_path):
    """A workspace on a hybrid target: the lean forward (and everything on it) is never proposed, and a
    draft-model config is refused when the deployment has no draft model."""
    import shutil

    from decoder.models import DEMO_DIR
    from workbench.agents.tuner import candidates
    from workbench.workspace import init_target

    torch.manual_seed(0)
    cfg = ARCHS["qwen3_next"]()
    cfg.vocab_size = 6144  # the demo tokenizer's
    model_dir = tmp_path / "hybrid"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "target" / f, model_dir / f)
    for p in (model_dir, *model_dir.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    ws = init_target(tmp_path / "ws", model_dir)
    assert "lean forward" in ws.refusal(DecodeConfig(drafter="ngram", lean_forward=True))
    assert "no draft model" in ws.refusal(DecodeConfig(drafter="draft-model"))
    assert ws.refusal(DecodeConfig(drafter="ngram")) is None
    # With a (Llama) draft model, tree verification is proposed on the HF path, without the lean forward.
    drafter_dir = tmp_path / "drafter"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(transformers.LlamaConfig(num_hidden_layers=1, **{**ATT, "vocab_size": 6144})
                                     ).save_pretrained(drafter_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "target" / f, drafter_dir / f)
    for p in (drafter_dir, *drafter_dir.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    with_drafter = init_target(tmp_path / "ws2", model_dir, drafter=drafter_dir)
    base2 = DecodeConfig.from_table(with_drafter.config_at(with_drafter.stock_commit), known_only=True)
    trees = [c for c in candidates(base2, "acceptance", [], refuse=with_drafter.refusal) if c.cfg.verify != "chain"]
    assert trees and not any(c.cfg.lean_forward for c in trees)
    base = DecodeConfig.from_table(ws.config_at(ws.stock_commit), known_only=True)
    unfiltered = [c for fam in ("host-overhead", "drafting", "verification") for c in candidates(base, fam, [])]
    kept = [c for fam in ("host-overhead", "drafting", "verification")
            for c in candidates(base, fam, [], refuse=ws.refusal)]
    assert any(c.cfg.lean_forward for c in unfiltered)  # the filter has something to remove
    assert kept and not any(c.cfg.lean_forward or (c.cfg.method, c.cfg.drafter) == ("sd", "draft-model")
                            for c in kept)


def test_near_tie_fraction_says_how_much_the_noise_floor_excuses():
    from decoder.lab.bench import WEAK_CHECK_FRACTION, format_table, near_tie_fraction

    target, _, prompt, ref, floor = _case("llama")
    assert near_tie_fraction(target, [(prompt, ref)], floor) < WEAK_CHECK_FRACTION  # fp32: a tight check
    assert near_tie_fraction(target, [(prompt, ref)], 1e6) == 1.0  # a floor that excuses everything
    report = {"deployment": "t", "prompts": "code", "num_prompts": 1, "max_new_tokens": 8, "dtype": "bfloat16",
              "device": "cpu", "noise_floor": 0.86, "near_tie_fraction": 0.4, "config": {},
              "methods": [{"name": "hf-greedy", "tokens_per_s": 10.0, "speedup_vs_ar": None,
                           "speedup_vs_hf_greedy": 1.0, "tau": 1.0, "target_forwards_per_token": 1.0,
                           "identical_to_hf_greedy": True,
                           "mismatched_prompts": 0, "unexplained_mismatches": 0}]}
    assert "WEAK LOSSLESS CHECK" in format_table(report)
    assert "WEAK" not in format_table({**report, "near_tie_fraction": 0.01})


@pytest.mark.parametrize("name", ["bamba", "qwen3_next"])
def test_a_lazy_rollback_leaves_the_accepted_tokens_to_the_next_forward(name):
    """With `lazy`, the cache stays at the saved point and the accepted tokens ride along with the next
    forward: the same chunks as a cache that never saw the rejected ones, bit for bit."""
    runner = as_runner(_build(name, 0))
    ids = list(range(3, 23))
    with torch.inference_mode():
        cache = runner.new_cache()
        runner.forward(torch.tensor(ids[:12]), cache)
        runner.forward(torch.tensor(ids[12:16]), cache)
        assert rollback(runner, cache, 14, ids, lazy=8) == 0  # nothing fed now
        assert cache.get_seq_length() == 12
        after = runner.forward(torch.tensor(ids[12:18]), cache)  # the 2 accepted tokens and 4 more
        assert rollback(runner, cache, 13, ids, lazy=0) == 1  # not lazy: restore to 12 and feed one token
        assert cache.get_seq_length() == 13
        fresh = runner.new_cache()
        runner.forward(torch.tensor(ids[:12]), fresh)
        expect = runner.forward(torch.tensor(ids[12:18]), fresh)
    assert torch.equal(after, expect)


@pytest.mark.parametrize("name", ["bamba", "qwen3_next"])
def test_a_recurrent_target_verifies_a_tree_as_one_row_per_branch(name):
    """Tree verification on a recurrent target: each node's logits are those of its branch run as a sequence
    from the same state, and after the accepted path is kept (through either branch) the cache continues
    exactly like one that only ever saw that path."""
    from decoder.tree import tree_attention_mask, tree_positions

    runner = as_runner(_build(name, 0))
    ids = list(range(3, 15))  # 12 committed tokens; a tree on the last (the root): a and b under it, c under a
    a, b, c = 41, 42, 43
    anc = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 0, 1])

    def fresh(*chunks):
        f = runner.new_cache()
        return [runner.forward(torch.tensor(ch), f) for ch in chunks]

    with torch.inference_mode():
        # Accept a (first branch: restored and re-fed), b (second branch, padded: the same), or a and c (the whole
        # first branch: its row is kept as it is, no restore, so the right row must be chosen).
        for path, accepted in (([0, 1], [a]), ([0, 2], [b]), ([0, 1, 3], [a, c])):
            cache = runner.new_cache()
            runner.forward(torch.tensor(ids[:11]), cache)
            logits = runner.forward(torch.tensor([ids[11], a, b, c]), cache, positions=tree_positions(depth, 11),
                                    attn_mask=tree_attention_mask(anc, 11))
            assert logits.shape[0] == 4 and len(cache.branches) == 2
            _, ac = fresh(ids[:11], [ids[11], a, c])  # the longest branch sets the rows' width
            _, bb = fresh(ids[:11], [ids[11], b, b])  # the short branch, padded with its leaf
            # A batch of two rows rounds a few last bits differently from one row (fp32): equal within 1e-5.
            assert torch.allclose(logits[[0, 1, 3]], ac, atol=1e-5) and torch.allclose(logits[2], bb[1], atol=1e-5)
            cache.compact(11, torch.tensor(path))  # keep a branch holding the path
            committed = ids + accepted + [44]
            rollback(runner, cache, len(committed) - 1, committed)
            after = runner.forward(torch.tensor([44, 45]), cache)
            expect = fresh(ids[:11], [ids[11], *accepted], [44, 45])[-1]
            if len(accepted) == 2:  # the kept row ran in a batch of two: last bits may differ
                assert torch.allclose(after, expect, atol=1e-5), path
            else:  # restored and re-fed as one row: exact
                assert torch.equal(after, expect), path
