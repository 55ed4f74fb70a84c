"""Feature drafters (block drafter, MTP heads, domain router): lossless decoding, training resume, wiring."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from decoder.capabilities import VOCAB_RANK_FILE, drafter_files_refusal
from decoder.config import ConfigError, DecodeConfig
from decoder.featdraft import (
    BlockDrafter,
    BlockDrafterConfig,
    BlockState,
    DomainRouter,
    FeatureDrafterError,
    FeatureHeads,
    MTPConfig,
    MTPHeads,
    MTPState,
    drafters_dir,
    load_feature_drafter,
    save_feature_drafter,
)
from decoder.generate import ar_generate, generate, speculative_generate
from decoder.lab.bench import first_divergence, top2_margin
from decoder.lab.train_drafter import (
    DrafterSpec,
    _positions,
    build_answer_data,
    capture_features,
    greedy_continue,
    train_feature_drafter,
)
from decoder.lean import LeanLM, StaticLeanLM
from decoder.models import DEMO_DIR, load_causal_lm, load_tokenizer
from decoder.proposer import Draft, Proposer
from workbench.agents.tuner import candidates
from workbench.cli import main

TRAINED = drafters_dir(DEMO_DIR / "target")
# Twice the demo target's bf16 noise floor (0.125: the largest logit difference between one-token and
# multi-token forwards, `specpilot bench`): a divergence at a smaller top-2 margin is a numerical near tie.
NEAR_TIE = 0.25


def _cfg(k: int, max_new_tokens: int = 40, **kw) -> DecodeConfig:
    """The loop's settings for a feature drafter handed in directly: 40 tokens, draft length k."""
    return DecodeConfig(max_new_tokens=max_new_tokens, draft_len=k, stop_at_eos=False, **kw)


# The sweep over every draft length decodes the first 24 of the reference's 40 tokens: each of its 16 cases
# verifies k + 1 positions a step, and the divergences it has to tell from near ties come early (position 18).
SWEEP_TOKENS = 24


@pytest.fixture(scope="module")
def target():
    return load_causal_lm(DEMO_DIR / "target", "target")


@pytest.fixture(scope="module")
def lean(target):
    return LeanLM(target)


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(DEMO_DIR / "target")
    rows = []
    for dom in ("code", "prose"):
        line = (DEMO_DIR / "prompts" / f"{dom}.jsonl").read_text().splitlines()[0]
        rows.append(tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"][-160:])
    return rows


@pytest.fixture(scope="module")
def references(lean, prompts):
    cfg = DecodeConfig(method="ar", lean_forward=True, max_new_tokens=40, stop_at_eos=False)
    return [ar_generate(lean, p, cfg).tokens for p in prompts]


@pytest.fixture(scope="module")
def untrained(target):
    """Randomly initialised drafters (no training): their drafts are mostly wrong, which exercises
    rejection at every slot; block size and heads 16 cover every draft length asked for."""
    c = target.config
    torch.manual_seed(0)
    block = BlockDrafter(BlockDrafterConfig(c.hidden_size, [1, 3, 5], c.vocab_size, block_size=16, inject_prev=True,
                                              slot_inputs=True))
    mtp = MTPHeads(MTPConfig(c.hidden_size, [5], c.vocab_size, num_heads=16), target.model.norm.weight)
    with torch.no_grad():
        mtp.w2.normal_(0, 0.02)
    return block.to(torch.bfloat16).eval(), mtp.to(torch.bfloat16).eval()


FAST_BLOCK_SIZES = (1, 2, 3, 4, 8, 16)  # the fast tier's edges and powers of two; `make test-slow` sweeps every size


@pytest.mark.parametrize("k", [k if k in FAST_BLOCK_SIZES else pytest.param(k, marks=pytest.mark.slow)
                               for k in range(1, 17)])
def test_block_and_mtp_drafters_are_lossless_for_every_block_size(k, target, lean, prompts, references, untrained):
    block, mtp = untrained
    for prompt, ref in zip(prompts, references, strict=True):
        ref = ref[:SWEEP_TOKENS]
        for state in (BlockState(block, lean.embed, lean.lm_head), MTPState(mtp, lean.embed, lean.lm_head)):
            g = speculative_generate(lean, state, prompt, _cfg(k, SWEEP_TOKENS))
            pos = first_divergence(g.tokens, ref)
            # bf16: a k-wide verify may round a near tie the other way (measured: k = 15 and 16 diverge from
            # AR at position 18 of the code context, top-2 margin 0.0625, one bf16 step at that magnitude)
            if pos is not None:
                with torch.inference_mode():
                    margin = top2_margin(target, prompt + ref[:pos])
                assert margin <= NEAR_TIE, (type(state).__name__, k, pos, margin)
            assert g.stats.draft_steps > 0 and g.stats.drafted <= k * g.stats.draft_steps


def test_feature_drafters_run_on_the_static_step(target, lean, prompts, references, untrained):
    """`cuda_graphs`: the static bucketed step hands the drafters the same hidden states (eager on the CPU,
    the code a CUDA graph captures), and feature drafters decode losslessly through it."""
    static = StaticLeanLM(lean, max_len=512, use_graphs=False)
    ids = torch.tensor(prompts[0][:20])
    logits_a, hid_a = lean.forward(ids, lean.new_cache(), capture=(1, 3, 5))
    logits_b, hid_b = static.forward(ids, static.new_cache(), capture=(1, 3, 5))
    assert hid_a.shape == hid_b.shape == (20, 3 * target.config.hidden_size)
    assert (hid_a.float() - hid_b.float()).abs().max() <= 0.02 * hid_a.float().abs().max()
    assert torch.equal(logits_a.argmax(-1), logits_b.argmax(-1))
    block, mtp = untrained
    for prompt, ref in zip(prompts, references, strict=True):
        for state in (BlockState(block, lean.embed, lean.lm_head), MTPState(mtp, lean.embed, lean.lm_head)):
            g = speculative_generate(static, state, prompt, _cfg(5))
            pos = first_divergence(g.tokens, ref)
            if pos is not None:
                with torch.inference_mode():
                    margin = top2_margin(target, prompt + ref[:pos])
                assert margin <= NEAR_TIE, (type(state).__name__, pos, margin)
            assert g.stats.draft_steps > 0


def test_drafts_that_are_always_right_are_all_accepted(lean, prompts, references):
    """A drafter that proposes the reference continuation is accepted in full: tau = k + 1 per step."""

    class Oracle(Proposer):
        """Reads the verify forward's hidden states (to count accepted positions) and drafts the reference."""

        capture = (5,)

        def __init__(self, ref, start):
            self.ref, self.start, self.pos = ref, start, 0

        def reset(self, prompt, hidden=None):
            self.pos = hidden.shape[0]

        def accepted(self, tokens, verdict):
            self.pos += verdict.hidden.shape[0]

        def propose(self, tokens, k):
            i = self.pos - self.start + 1  # index in ref of the token after the last committed one
            return Draft(torch.tensor(self.ref[i : i + k], dtype=torch.long))

    prompt, ref = prompts[0], references[0]
    g = speculative_generate(lean, Oracle(ref, len(prompt)), prompt, _cfg(4))
    assert g.tokens == ref
    assert g.stats.accepted == g.stats.drafted  # every draft token accepted
    assert g.stats.target_forwards == 1 + 8  # prefill, then 39 tokens in steps of 5 (4 + bonus)


@pytest.mark.skipif(not (TRAINED / "block" / "config.json").exists(), reason="demo feature drafters not trained")
@pytest.mark.parametrize("kind", ["block", "mtp"])
def test_trained_demo_drafters_are_lossless_and_accept_drafts(kind, target, lean, prompts, references):
    heads = FeatureHeads(TRAINED, target.config, torch.bfloat16, torch.device("cpu"))
    for prompt, ref in zip(prompts, references, strict=True):
        g = speculative_generate(lean, heads.state(kind, lean), prompt, _cfg(4))
        assert g.tokens == ref
        # Trained: above AR's 1.0. Measured with the committed drafters (code, prose context): block 1.176,
        # 1.379; MTP 1.25, 1.481. The bar keeps >= 10% of the smallest.
        assert g.stats.tau > 1.05, (kind, g.stats.tau)


def _same_or_near_tie(target, prompt: list[int], got: list[int], ref: list[int], what: str) -> None:
    """Token-identical to the AR reference, or diverging first where the reference's top-2 logits (the bf16
    target on the reference prefix) are a near tie: the lossless rule, not a decoding error (seen on an AMD
    EPYC host, whose bf16 matmuls round differently from the Intel hosts this test was written on)."""
    if got == ref:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    assert i < min(len(got), len(ref)), (what, "lengths differ", len(got), len(ref))
    with torch.no_grad():
        top = torch.topk(target(torch.tensor([prompt + ref[:i]])).logits[0, -1].float(), 2).values
    margin = float(top[0] - top[1])
    assert margin < NEAR_TIE, (what, f"diverges at {i} where the reference's margin is {margin:.3f}")


def test_generate_dispatches_block_mtp_and_routed(target, prompts, references, untrained, tmp_path):
    block, mtp = untrained
    save_feature_drafter(block, tmp_path / "block")
    save_feature_drafter(mtp, tmp_path / "mtp")
    vocab = target.config.vocab_size
    # A router that sends everything to prose (bias > 0, zero weights).
    DomainRouter([0.0] * vocab, 1.0).save(tmp_path / "router.json")
    heads = FeatureHeads(tmp_path, target.config, torch.bfloat16, torch.device("cpu"))
    # cuda_graphs = true: the static step (eager here; the CUDA graph replay is scripts/gpu_check_graphs.py's)
    for drafter, graphs in (("block", False), ("mtp", False), ("routed", False), ("block", True), ("mtp", True)):
        cfg = DecodeConfig(drafter=drafter, lean_forward=True, cuda_graphs=graphs, draft_len=5, max_new_tokens=40,
                           stop_at_eos=False)
        g = generate(cfg, target, prompts[0], heads=heads)
        _same_or_near_tie(target, prompts[0], g.tokens, references[0], drafter)
        if drafter == "routed":
            assert dict(g.stats.routes) == {"prose:mtp": 1}
    with pytest.raises(ValueError, match="FeatureHeads"):
        generate(DecodeConfig(drafter="block", lean_forward=True), target, prompts[0])


def test_config_names_what_a_feature_drafter_needs():
    with pytest.raises(ConfigError, match="lean_forward = True"):
        DecodeConfig(drafter="block")
    with pytest.raises(ConfigError, match="verify = 'chain'"):
        DecodeConfig(drafter="mtp", lean_forward=True, verify="tree")
    assert DecodeConfig(drafter="mtp", lean_forward=True, temperature=0.7).temperature == 0.7  # sampled: allowed
    with pytest.raises(ConfigError, match="route_code"):
        DecodeConfig(drafter="routed", lean_forward=True, route_code="medusa")
    cfg = DecodeConfig(drafter="routed", lean_forward=True, route_prose="ngram")
    assert DecodeConfig.from_toml(cfg.to_toml()) == cfg


@pytest.mark.parametrize("kind", ["block", "mtp"])
def test_sampled_feature_drafters_follow_the_target_distribution(kind):
    """Feature drafters run sampled through the one loop (rejection sampling, one-hot q): the second token,
    which passes through verification, follows the target's exact marginal (enumerated, 16-token vocabulary)."""
    target = tiny_llama(seed=0)
    lean = LeanLM(target, max_len=64)
    torch.manual_seed(5)
    if kind == "block":
        model = BlockDrafter(BlockDrafterConfig(32, [0, 1], 16, num_heads=2, num_kv_heads=1, intermediate=64,
                                                block_size=4, max_position=64)).eval()
        state = BlockState(model, lean.embed, lean.lm_head, max_len=64)
    else:
        model = MTPHeads(MTPConfig(32, [1], 16, num_heads=2), target.model.norm.weight).eval()
        with torch.no_grad():
            model.w2.normal_(0, 0.3)
        state = MTPState(model, lean.embed, lean.lm_head)
    prompt = [3, 7, 1]
    with torch.inference_mode():
        # Temperature 3 flattens the sharp tiny target, so random drafts are sometimes accepted.
        p0 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1] / 3, -1)
        p1 = torch.softmax(target(input_ids=torch.tensor([prompt + [t] for t in range(16)])).logits[:, -1] / 3, -1)
    exact = (p0[:, None] * p1).sum(0)  # [16] marginal of the second new token
    cfg = DecodeConfig(max_new_tokens=3, temperature=3.0, draft_len=2, dtype="float32", stop_at_eos=False)
    gen = torch.Generator().manual_seed(99)
    counts, n, drafted, accepted = torch.zeros(16), 3000, 0, 0
    for _ in range(n):
        g = speculative_generate(lean, state, prompt, cfg, generator=gen)
        counts[g.tokens[1]] += 1
        drafted, accepted = drafted + g.stats.drafted, accepted + g.stats.accepted
    assert 0 < accepted < drafted  # both branches of the rejection rule ran
    expected = exact * n
    mask = expected > 5
    chi2 = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
    dof = int(mask.sum()) - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5 + 10, (chi2, dof)  # ~p < 0.001 for these dof


def test_loading_checks_the_drafter_fits_the_target(target, untrained, tmp_path):
    with pytest.raises(FeatureDrafterError, match="train one"):
        load_feature_drafter(tmp_path / "nothing", target.config, torch.bfloat16, torch.device("cpu"))
    block, _ = untrained
    save_feature_drafter(block, tmp_path / "b")
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    cfg["target_hidden"] = 512
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FeatureDrafterError, match="retrain it for this target"):
        load_feature_drafter(tmp_path / "b", target.config, torch.bfloat16, torch.device("cpu"))


def test_router_round_trip_and_choice(tmp_path):
    r = DomainRouter([0.0, 2.0, -2.0], -0.1)
    r.save(tmp_path / "r.json")
    back = DomainRouter.load(tmp_path / "r.json")
    assert back.route([1, 1, 0]) == "prose" and back.route([2, 0]) == "code"
    assert back.route([]) == "code"  # the bias alone decides an empty prompt


@pytest.mark.skipif(not (TRAINED / "router.json").exists(), reason="demo router not trained")
def test_trained_router_separates_the_demo_prompt_sets():
    tok = load_tokenizer(DEMO_DIR / "target")
    router = DomainRouter.load(TRAINED / "router.json")
    for dom in ("code", "prose"):
        texts = [json.loads(x)["text"] for x in (DEMO_DIR / "prompts" / f"{dom}.jsonl").read_text().splitlines()]
        right = sum(router.route(tok(t, add_special_tokens=False)["input_ids"]) == dom for t in texts)
        assert right >= 0.9 * len(texts), dom


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    """The token streams the training tests read (`corpus_streams` finds them cached), tokenised once from a
    slice of the corpus: the first documents of each domain in each split, ample for their dozen short
    sequences (the whole corpus, 10 MB, takes 20 s to tokenise here)."""
    from decoder.lab.corpus import all_documents
    from decoder.lab.train import split_of, tokenize_corpus

    work = tmp_path_factory.mktemp("drafter-work")
    picked: dict[tuple[str, str], list] = {}
    for d in all_documents():
        group = picked.setdefault((d.domain, split_of(d.id, d.domain)), [])
        if len(group) < 6:
            group.append(d)
    tokenize_corpus([d for group in picked.values() for d in group], DEMO_DIR / "target", work / "tokens", 3)
    return work


@pytest.mark.parametrize("kind", ["block", "mtp"])
def test_training_resumes_to_the_same_weights(kind, token_cache, tmp_path):
    import shutil

    from safetensors.torch import load_file

    spec = DrafterSpec(kind=kind, train_sequences=12, val_sequences=4, shard_size=8, prefix_len=24, gen_len=16,
                       steps=6, batch_size=2, anchors_per_seq=3, block_size=4, num_heads_mtp=3, intermediate=64,
                       warmup_steps=2, checkpoint_every=100)
    work2 = tmp_path / "w2"
    straight = train_feature_drafter(DEMO_DIR / "target", tmp_path / "out1", token_cache, spec, progress=False)
    shutil.copytree(token_cache, work2, ignore=shutil.ignore_patterns("*.ckpt.pt"))  # same data, no checkpoint
    assert train_feature_drafter(DEMO_DIR / "target", tmp_path / "out2", work2, spec, progress=False,
                                 stop_after=3) is None  # "killed" after 3 steps, with a checkpoint
    assert not (tmp_path / "out2").exists()
    resumed = train_feature_drafter(DEMO_DIR / "target", tmp_path / "out2", work2, spec, progress=False)
    a = load_file(tmp_path / "out1" / "model.safetensors")
    b = load_file(tmp_path / "out2" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert straight["val"] == resumed["val"]
    assert json.loads((tmp_path / "out1" / "recipe.json").read_text())["spec"]["seed"] == 0
    # The trained drafter loads and decodes losslessly.
    target = load_causal_lm(DEMO_DIR / "target", "target")
    m = load_feature_drafter(tmp_path / "out1", target.config, torch.bfloat16, torch.device("cpu"))
    assert m.c.kind == kind


def test_training_refuses_a_checkpoint_of_another_recipe(token_cache, tmp_path):
    import shutil

    spec = DrafterSpec(kind="mtp", train_sequences=8, val_sequences=4, shard_size=8, prefix_len=24, gen_len=16,
                       steps=4, batch_size=2, anchors_per_seq=2, num_heads_mtp=2, warmup_steps=1)
    work = tmp_path / "w"
    shutil.copytree(token_cache, work, ignore=shutil.ignore_patterns("*.ckpt.pt"))
    train_feature_drafter(DEMO_DIR / "target", tmp_path / "o", work, spec, progress=False, stop_after=2)
    spec.lr = 1e-2
    with pytest.raises(SystemExit, match="different recipe"):
        train_feature_drafter(DEMO_DIR / "target", tmp_path / "o", work, spec, progress=False)


def test_serve_answers_with_the_block_drafter(tmp_path, target, untrained, prompts, references):
    """The system entry point decodes with drafter = block from --drafters, token-identical to AR."""
    block, mtp = untrained
    save_feature_drafter(block, tmp_path / "d" / "block")
    cfg = DecodeConfig(drafter="block", lean_forward=True, draft_len=6)
    (tmp_path / "system.toml").write_text(cfg.to_toml())
    req = {"id": 1, "prompt_ids": prompts[0], "max_new_tokens": 40, "config": {"stop_at_eos": False},
           "profile": True}
    out = subprocess.run(
        [sys.executable, "-m", "decoder.serve", "--target", str(DEMO_DIR / "target"), "--config",
         str(tmp_path / "system.toml"), "--drafters", str(tmp_path / "d")],
        input=json.dumps(req) + "\n", capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert lines[0]["ready"] is True, out.stderr[-2000:]
    assert lines[1]["tokens"] == references[0], lines[1]
    assert lines[1]["stats"]["drafted"] > 0


def _prompt_file(tmp_path):
    rows = [json.loads(x) for dom in ("code", "prose")
            for x in (DEMO_DIR / "prompts" / f"{dom}.jsonl").read_text().splitlines()[:2]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.skipif(not (TRAINED / "router.json").exists() or not (TRAINED / "block" / "config.json").exists(),
                    reason="demo feature drafters not trained")
def test_bench_reports_feature_methods_lossless_with_routes(tmp_path):
    from decoder.lab.bench import run_bench

    report = run_bench(DEMO_DIR / "target", DEMO_DIR / "drafter", str(_prompt_file(tmp_path)), 24,
                       methods=("ar-lean", "sd-block", "sd-mtp", "sd-routed"), noise_prompts=2, progress=False)
    by = {m["name"]: m for m in report["methods"]}
    for name in ("sd-block", "sd-mtp", "sd-routed"):
        assert by[name]["unexplained_mismatches"] == 0, by[name]
        assert by[name]["ar_baseline"] == "ar-lean"
        assert by[name]["draft_ms_per_step"] > 0
    routed = by["sd-routed"]
    assert sum(routed["routes"].values()) == 4  # every request routed once, the choice reported
    assert set(routed["routes"]) <= {"code:block", "prose:mtp", "code:mtp", "prose:block"}
    assert routed["route_us_per_request"] > 0
    assert report["config"]["feature"]["block_draft_len"] == 8


def test_bench_without_feature_drafters_names_the_fix(tmp_path):
    from decoder.lab.bench import BenchError, FeatureSettings, run_bench

    with pytest.raises(BenchError, match="train drafter"):
        run_bench(DEMO_DIR / "target", None, str(_prompt_file(tmp_path)), 4, methods=("sd-block",),
                  feature=FeatureSettings(drafters=str(tmp_path / "none")), progress=False)


def test_a_deployment_with_mtp_heads_only_skips_the_other_feature_methods_by_name(tmp_path):
    """SmolLM2 carries MTP heads and no block drafter: the default method set runs sd-mtp and skips sd-block and
    sd-routed each with what it lacks; naming sd-block explicitly is the one-line error."""
    from decoder.config import DecodeConfig
    from decoder.lab.bench import BenchError, FeatureSettings, TreeSettings, select_methods

    (tmp_path / "mtp").symlink_to(DEMO_DIR / "target" / "drafters" / "mtp", target_is_directory=True)
    feature, cfg = FeatureSettings(drafters=str(tmp_path)), DecodeConfig(method="sd", drafter="ngram")
    methods = ("ar", "sd-block", "sd-mtp", "sd-routed")
    keep, skipped = select_methods(methods, True, DEMO_DIR / "target", None, cfg, 8, TreeSettings(), feature)
    assert keep == ("ar", "sd-mtp")
    reasons = {s["name"]: s["reason"] for s in skipped}
    assert reasons["sd-block"].startswith(f"no block drafter at {tmp_path}; train it with `specpilot train "
                                          f"drafter --kind block")
    assert reasons["sd-routed"].startswith(f"no router at {tmp_path}; train it with `specpilot train drafter "
                                           f"--kind router")  # both routes go to the MTP heads, which are there
    with pytest.raises(BenchError, match="--methods sd-block: no block drafter"):
        select_methods(("ar", "sd-block"), False, DEMO_DIR / "target", None, cfg, 8, TreeSettings(), feature)


def _answer_rows(tok, target, prompts: list[str], gen: int) -> list[dict]:
    """The demo target's own greedy answers to `prompts`, as `train smollm2-drafter --only data` writes them."""
    rows = []
    for text in prompts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out = greedy_continue(target, torch.tensor([ids]), gen)[0].tolist()
        rows.append({"text": text, "prompt": text, "tokens": out})
    return rows


def test_mtp_heads_train_on_a_chat_deployments_answers(tmp_path, target):
    """`--answers`: rows of (prompt, the target's answer) become aligned fixed-length rows whose features are
    the target's own over the real context; a long prompt keeps its tail, a too-short answer is dropped, and
    no drawn position reaches past a row's answer."""
    tok = load_tokenizer(DEMO_DIR / "target")
    texts = ["def add(a, b):", "The river", "import os\nimport sys\n\ndef main():\n    path = os.getcwd()",
             "class Stack:", "Once upon a time", "for i in range(10):", "x = [1, 2, 3]\ny =", "# sort a list"]
    rows = _answer_rows(tok, target, texts, 12)
    rows[3]["tokens"] = rows[3]["tokens"][:3]  # too short for 3 heads: dropped
    rows[4]["tokens"] = rows[4]["tokens"][:7]  # shorter than gen_len: kept, its positions bounded
    f = tmp_path / "answers.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DrafterSpec(kind="mtp", answers=str(f), train_sequences=100, val_sequences=2, shard_size=4,
                       prefix_len=8, gen_len=10, steps=4, batch_size=2, anchors_per_seq=3, num_heads_mtp=3,
                       warmup_steps=1)
    layers = (target.config.num_hidden_layers - 1,)
    data = build_answer_data(target, DEMO_DIR / "target", tmp_path / "w", spec, layers)
    seqs = np.concatenate([data["train"][0], data["val"][0]])
    lens = np.concatenate([data["train"][3], data["val"][3]])
    feats = [np.asarray(s) for s in data["train"][1] + data["val"][1]]
    feats = np.concatenate(feats)
    assert len(seqs) == 7 and seqs.shape[1] == 18
    for r in rows:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        a = r["tokens"][:10]
        hits = [j for j in range(len(seqs)) if seqs[j, 8: 8 + len(a)].tolist() == a and lens[j] == 8 + len(a)
                and seqs[j, max(0, 8 - len(p)): 8].tolist() == p[-8:]]
        assert (len(hits) == 1) == (len(r["tokens"]) >= 5), r["text"]
        if len(p) > 8 and hits:  # the long prompt: features of the full context, not of its kept tail
            full = capture_features(target, torch.tensor([p + a]), layers)[0].to(torch.bfloat16)
            got = torch.from_numpy(feats[hits[0], 8 - 1]).view(torch.bfloat16)
            assert torch.equal(got, full[len(p) - 1])
    pos = _positions(spec, np.random.default_rng(0), np.full(50, 8 + 5))
    assert int(pos.min()) == 7 and int(pos.max()) == 8 + 5 - 2 - 3
    recipe = train_feature_drafter(DEMO_DIR / "target", tmp_path / "out", tmp_path / "w", spec, progress=False)
    assert recipe["spec"]["answers"] == str(f) and recipe["val"]["blocks"] == 2 * 3


def test_train_drafter_answers_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "tokens": [1, 2]}\n{"prompt": "b"}\n')
    cases = [(["drafter", "--kind", "mtp", "--answers", str(tmp_path / "missing.jsonl")], "not a file"),
             (["drafter", "--kind", "router", "--answers", str(bad)],
              "only for --kind block, mtp, vocab, corpus or lookup-cache"),
             (["drafter", "--kind", "mtp", "--answers", str(bad), "--work-dir", str(tmp_path / "w")], "line 2 needs"),
             (["demo", "--only", "data"], "--only data: use target or drafter"),
             (["smollm2-drafter", "--only", "target"], "--only target: use data")]
    for argv, msg in cases:
        assert main(["train", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").rglob("*.npy"))


def test_vocab_rank_from_a_chat_deployments_answers(tmp_path, capsys):
    """`train drafter --kind vocab --answers`: tokens ranked by their counts in the training rows' answers (ties
    by id), coverage measured on the held-out rows (the MTP heads' validation split), ids outside the target's
    vocabulary refused in one line."""
    rng = np.random.default_rng(3)
    rows = [{"prompt": f"q{i}", "tokens": [int(t) for t in rng.choice([5, 7, 9, 11], size=20, p=[.4, .3, .2, .1])]}
            for i in range(DrafterSpec().val_sequences + 40)]
    f = tmp_path / "answers.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "vocab_rank.json"
    assert main(["train", "drafter", "--kind", "vocab", "--answers", str(f), "--out", str(out)]) == 0
    rank = json.loads(out.read_text())
    held = set(np.random.default_rng([0, 9]).permutation(len(rows))[: DrafterSpec().val_sequences].tolist())
    train = [t for i, r in enumerate(rows) if i not in held for t in r["tokens"]]
    counts = {t: train.count(t) for t in (5, 7, 9, 11)}
    assert rank["ids"][:4] == sorted(counts, key=lambda t: (-counts[t], t)) and rank["ids"][4:7] == [0, 1, 2]
    assert rank["train_tokens"] == len(train) and rank["val_coverage"]["512"] == 1.0
    assert sorted(rank["ids"]) == list(range(len(rank["ids"]))) and "answer token counts" in rank["source"]
    capsys.readouterr()
    f.write_text("".join(json.dumps({"prompt": "q", "tokens": [10 ** 7]}) + "\n" for _ in range(200)))
    assert main(["train", "drafter", "--kind", "vocab", "--answers", str(f), "--out", str(tmp_path / "v2")]) == 2
    err = capsys.readouterr().err
    assert "outside the target's vocabulary" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "v2").exists()
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["train", "drafter", "--kind", "vocab", "--answers", str(f), "--out", str(blocker / "v.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "writable path" in err and len(err.strip().splitlines()) == 1


def test_drafter_files_refusal_names_what_is_missing_and_the_tuner_proposes_only_what_is_there(tmp_path):
    """A config needing feature drafters, a router or the token ranking the target's drafters directory lacks
    is refused in one line naming the file and the command that makes it; the drafting tuner then offers the
    pruned head for the draft model only where the ranking exists (the demo's), and no head at all without."""
    empty = tmp_path / "drafters"
    empty.mkdir()
    lean = dict(method="sd", lean_forward=True)
    cases = {"mtp": (DecodeConfig(drafter="mtp", **lean), "no mtp heads at"),
             "block": (DecodeConfig(drafter="block", **lean), "no block drafter at"),
             "routed": (DecodeConfig(drafter="routed", **lean), "no router at"),
             "ranked": (DecodeConfig(drafter="draft-model", draft_vocab=512, **lean), VOCAB_RANK_FILE)}
    for name, (cfg, want) in cases.items():
        why = drafter_files_refusal(cfg, empty, "T")
        assert why is not None and want in why and "specpilot train drafter --kind" in why and "\n" not in why, name
        assert drafter_files_refusal(cfg, TRAINED) is None, name
    assert drafter_files_refusal(DecodeConfig(drafter="draft-model", **lean), empty) is None
    assert drafter_files_refusal(DecodeConfig(method="ar", drafter="mtp"), empty) is None

    base = DecodeConfig(drafter="draft-model", **lean)
    demo = candidates(base, "drafting", [], refuse=lambda c: drafter_files_refusal(c, TRAINED))
    bare = candidates(base, "drafting", [], refuse=lambda c: drafter_files_refusal(c, empty))
    assert any(c.cfg.drafter == "draft-model" and c.cfg.draft_vocab for c in demo)
    assert any(c.cfg.drafter == "mtp" for c in demo)
    assert bare and not any(c.cfg.draft_vocab or c.cfg.drafter in ("mtp", "block", "routed") for c in bare)
