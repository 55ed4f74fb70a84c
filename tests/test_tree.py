"""Tree verification, two-level verification and D-cut: masks, positions, compaction, acceptance, lossless."""

import random

import pytest
import torch
from conftest import needs_demo, tiny_llama

from decoder.config import ConfigError, DecodeConfig
from decoder.dcut import DCutDrafter, batch_verify_budget
from decoder.drafters import DraftModelDrafter
from decoder.generate import ar_generate, generate, speculative_generate
from decoder.lean import LeanLM
from decoder.tree import (
    DraftTree,
    TreeDrafter,
    TwoLevelDrafter,
    greedy_tree_accept,
    tree_attention_mask,
    tree_positions,
)


def random_tree(n: int, vocab: int, rng: random.Random) -> DraftTree:
    """A random tree of n nodes (parents precede children), distinct tokens among siblings."""
    parents, depth, tokens, used = [], [], [], {}
    for i in range(n):
        p = rng.choice([q for q in range(-1, i) if len(used.get(q, ())) < vocab])
        parents.append(p)
        depth.append(0 if p < 0 else depth[p] + 1)
        free = [t for t in range(vocab) if t not in used.setdefault(p, set())]
        tok = rng.choice(free)
        used[p].add(tok)
        tokens.append(tok)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth), anc, torch.ones(n),
                     torch.full((n,), -1), 0)


def path_to(tree: DraftTree, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = int(tree.parents[i])
    return out[::-1]


def test_mask_and_positions_match_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        n, prefix = rng.randrange(1, 12), rng.randrange(0, 7)
        tree = random_tree(n, 16, rng)
        mask = tree_attention_mask(tree.anc, prefix)
        pos = tree_positions(tree.depth, prefix)
        assert mask.shape == (1 + n, prefix + 1 + n)
        # Brute force: row r (0 = root, i + 1 = node i) may see the prefix, the root, and its path's nodes.
        for r in range(1 + n):
            seen = set(range(prefix + 1)) | ({prefix + 1 + j for j in path_to(tree, r - 1)} if r else set())
            assert {c for c in range(prefix + 1 + n) if mask[r, c]} == seen
            assert int(pos[r]) == prefix + (len(path_to(tree, r - 1)) if r else 0)


@torch.inference_mode()
def test_tree_forward_logits_equal_per_path_recomputation():
    """Every node's logits from one tree forward equal a plain causal forward of prefix + root + its path."""
    lean = LeanLM(tiny_llama(vocab=16, hidden=32, layers=2, seed=3))
    rng = random.Random(1)
    for _ in range(8):
        prefix = [rng.randrange(16) for _ in range(rng.randrange(1, 10))]
        root = rng.randrange(16)
        tree = random_tree(rng.randrange(1, 14), 16, rng)
        cache = lean.new_cache()
        lean.forward(torch.tensor(prefix), cache)
        ids = torch.cat([torch.tensor([root]), tree.tokens])
        logits = lean.forward(ids, cache, positions=tree_positions(tree.depth, len(prefix)),
                              attn_mask=tree_attention_mask(tree.anc, len(prefix)))
        for r in range(1 + tree.size):
            path = [int(tree.tokens[j]) for j in path_to(tree, r - 1)] if r else []
            ref_cache = lean.new_cache()
            ref = lean.forward(torch.tensor(prefix + [root] + path), ref_cache, last_only=True)[0]
            assert torch.allclose(logits[r], ref, atol=1e-5), r


@torch.inference_mode()
def test_kv_compaction_is_exact():
    lean = LeanLM(tiny_llama(vocab=16, hidden=32, layers=2, seed=4))
    rng = random.Random(2)
    for _ in range(8):
        prefix = [rng.randrange(16) for _ in range(5)]
        tree = random_tree(10, 16, rng)
        cache = lean.new_cache()
        lean.forward(torch.tensor(prefix), cache)
        start = cache.length
        lean.forward(torch.cat([torch.tensor([7]), tree.tokens]), cache,
                     positions=tree_positions(tree.depth, start), attn_mask=tree_attention_mask(tree.anc, start))
        leaf = rng.randrange(tree.size)
        rows = torch.tensor([0] + [j + 1 for j in path_to(tree, leaf)])
        before_k, before_v = cache.k[:, :, start + rows].clone(), cache.v[:, :, start + rows].clone()
        prefix_k = cache.k[:, :, :start].clone()
        cache.compact(start, rows)
        assert cache.length == start + rows.shape[0]
        assert torch.equal(cache.k[:, :, start : cache.length], before_k)  # moved bit for bit
        assert torch.equal(cache.v[:, :, start : cache.length], before_v)
        assert torch.equal(cache.k[:, :, :start], prefix_k)
        # The compacted cache continues exactly like one that was fed only the accepted path.
        ref = lean.new_cache()
        lean.forward(torch.tensor(prefix + [7] + [int(tree.tokens[j]) for j in path_to(tree, leaf)]), ref)
        assert torch.allclose(cache.k[:, :, : cache.length], ref.k[:, :, : ref.length], atol=1e-5)
        nxt = torch.tensor([3, 5])
        assert torch.allclose(lean.forward(nxt, cache), lean.forward(nxt, ref), atol=1e-5)


def test_greedy_tree_accept_matches_brute_force_walk():
    rng = random.Random(3)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tree = random_tree(rng.randrange(1, 15), 4, rng)  # vocab 4: matches are frequent
        logits = torch.randn(1 + tree.size, 4, generator=g)
        pred = logits.argmax(-1).tolist()
        node, path = -1, []  # walk from the root: follow the child carrying the target's token
        while True:
            want = pred[node + 1]
            child = [i for i in range(tree.size) if int(tree.parents[i]) == node and int(tree.tokens[i]) == want]
            if not child:
                break
            node = child[0]
            path.append(node)
        out = greedy_tree_accept(logits, tree).tolist()
        n = out[0]
        assert n == len(path)
        assert out[2 : 2 + n] == path
        assert out[2 + tree.size : 2 + tree.size + n] == [int(tree.tokens[i]) for i in path]
        assert out[1] == pred[node + 1]


def _tiny_pair(seed: int):
    return (tiny_llama(vocab=16, hidden=32, layers=2, seed=seed),
            tiny_llama(vocab=16, hidden=32, layers=1, seed=seed + 50))


def _cfg(**kw) -> DecodeConfig:
    return DecodeConfig(**{**dict(max_new_tokens=40, dtype="float32", stop_at_eos=False, lean_forward=True), **kw})


def test_every_mechanism_lossless_on_random_trees_and_drafts():
    """Greedy token identity with AR across random tree shapes, budgets, alternatives and D-cut thresholds."""
    rng = random.Random(4)
    for seed in range(4):
        target, draft = _tiny_pair(seed)
        lt, ld = LeanLM(target), LeanLM(draft)
        for _ in range(6):
            prompt = [rng.randrange(1, 16) for _ in range(rng.randrange(1, 12))]
            ref = ar_generate(target, prompt, _cfg(method="ar", lean_forward=False)).tokens
            shape = ",".join(str(rng.randrange(1, 4)) for _ in range(rng.randrange(1, 5)))
            k, d = rng.randrange(1, 7), rng.randrange(1, 7)
            configs = [
                _cfg(verify="tree", tree_shape=shape),
                _cfg(verify="tree", tree_topk=k, tree_depth=d, tree_budget=rng.randrange(1, 40)),
                _cfg(verify="two-level", two_level_alts=rng.randrange(1, 5), draft_len=rng.randrange(1, 7)),
                _cfg(dcut=True, dcut_threshold=rng.uniform(0.01, 0.99), draft_len=rng.randrange(1, 9)),
            ]
            for cfg in configs:
                g = generate(cfg, target, prompt, draft)
                assert g.tokens == ref, cfg
                assert g.stats.tau >= 1.0
            # The loops called directly on lean models, as the bench does.
            assert speculative_generate(lt, TreeDrafter.from_config(ld, configs[1]), prompt, configs[1]).tokens == ref
            assert speculative_generate(lt, TwoLevelDrafter(ld, configs[2].two_level_alts), prompt,
                                        configs[2]).tokens == ref


def test_chain_is_a_tree_of_width_one():
    target, draft = _tiny_pair(7)
    prompt = [3, 1, 4, 1, 5]
    chain = speculative_generate(LeanLM(target), DraftModelDrafter(LeanLM(draft)), prompt, _cfg(draft_len=3))
    tcfg = _cfg(verify="tree", tree_shape="1,1,1")
    tree = speculative_generate(LeanLM(target), TreeDrafter.from_config(LeanLM(draft), tcfg), prompt, tcfg)
    assert tree.tokens == chain.tokens
    assert tree.stats.target_forwards == chain.stats.target_forwards
    assert dict(tree.stats.accept_hist) == dict(chain.stats.accept_hist)


@torch.inference_mode()
def test_tree_drafter_cache_tracks_committed_sequence():
    """After every step the drafter's cache equals a causal forward of a prefix of the committed tokens."""
    target, draft = _tiny_pair(8)
    lt, ld = LeanLM(target), LeanLM(draft)
    seen = []
    orig = TreeDrafter.keep_path

    def keep_path(self, rows):
        orig(self, rows)
        seen.append((self, self.cache_len))

    TreeDrafter.keep_path = keep_path
    try:
        prompt = [2, 7, 1, 8, 2, 8]
        cfg = _cfg(verify="tree", tree_topk=3, tree_depth=4, tree_budget=10)
        out = speculative_generate(lt, TreeDrafter.from_config(ld, cfg), prompt, cfg).tokens
    finally:
        TreeDrafter.keep_path = orig
    assert seen
    drafter, cache_len = seen[-1]
    committed = prompt + out
    ref = ld.new_cache()
    ld.forward(torch.tensor(committed[:cache_len]), ref)
    assert torch.allclose(drafter.cache.k[:, :, :cache_len], ref.k[:, :, :cache_len], atol=1e-5)


@needs_demo
@pytest.mark.slow  # the fast twin: test_every_mechanism_lossless_on_random_trees_and_drafts (tiny models)
def test_demo_fp32_lossless_and_two_level_accepts_alternatives(demo_fp32, demo_prompts):
    target, draft = demo_fp32
    base = dict(max_new_tokens=48, dtype="float32", stop_at_eos=False, lean_forward=True)
    alternatives = 0
    for prompt in demo_prompts:
        ref = ar_generate(target, prompt, DecodeConfig(method="ar", **{**base, "lean_forward": False})).tokens
        for kw in (dict(verify="tree"), dict(verify="tree", tree_shape="4,2,1,1"), dict(dcut=True, draft_len=8)):
            assert generate(DecodeConfig(**base, **kw), target, prompt, draft).tokens == ref, kw
        two = generate(DecodeConfig(**base, verify="two-level", draft_len=3), target, prompt, draft)
        assert two.tokens == ref
        assert two.stats.drafter_forwards <= 3 * two.stats.draft_steps  # level 2 costs no drafter forward
        alternatives += two.stats.alternatives_accepted
    assert alternatives > 0  # level 2 (an alternative beside the broken chain node) really fires on the demo


def test_comb_tree_structure():
    from decoder.tree import comb_tree

    tree = comb_tree(torch.tensor([10, 11, 12]), torch.tensor([[20, 21], [22, 23], [24, 25]]))
    assert tree.tokens.tolist() == [10, 11, 12, 20, 21, 22, 23, 24, 25]
    assert tree.parents.tolist() == [-1, 0, 1, -1, -1, 0, 0, 1, 1]
    assert tree.depth.tolist() == [0, 1, 2, 0, 0, 1, 1, 2, 2]
    for i in range(tree.size):
        assert {j for j in range(tree.size) if tree.anc[i, j]} == set(path_to(tree, i))


@torch.inference_mode()
def test_dcut_cuts_where_running_product_falls_below_threshold():
    _, draft = _tiny_pair(9)
    lean = LeanLM(draft)
    tokens = [1, 2, 3, 4]
    lengths = set()
    for threshold in (0.05, 0.3, 0.6, 0.9, 0.99):
        d = DCutDrafter(lean, threshold)
        d.reset(tokens)
        out = d.draft(tokens, 8)[0].tolist()
        # Brute force: greedy continuation with a fresh causal forward per position.
        product, expect = 1.0, []
        seq = list(tokens)
        for _ in range(8):
            p = torch.softmax(lean.forward(torch.tensor(seq), lean.new_cache(), last_only=True)[0], -1)
            product *= float(p.max())
            expect.append(int(p.argmax()))
            seq.append(expect[-1])
            if product < threshold:
                break
        assert out == expect, threshold
        assert d.forwards == len(out)  # no drafter forward is wasted on a dropped token
        assert d.products == sorted(d.products, reverse=True)
        lengths.add(len(out))
    assert len(lengths) > 1  # the threshold really changes where the draft is cut
    with pytest.raises(ValueError, match="threshold 1.5"):
        DCutDrafter(lean, 1.5)


def test_batch_verify_budget_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        b, k = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        products = torch.rand(b, k, generator=g).cumprod(dim=1)
        products[0, k // 2 + 1 :] = 0.0  # a request with a shorter draft
        budget = int(torch.randint(0, b * k + 2, (1,), generator=g))
        threshold = float(torch.rand(1, generator=g)) * 0.3
        min_len = int(torch.randint(0, 3, (1,), generator=g))
        lengths = batch_verify_budget(products, budget, threshold, min_len).tolist()
        # Brute force over (request, position) pairs.
        guaranteed = {(r, i) for r in range(b) for i in range(min(min_len, k)) if products[r, i] > 0}
        rest = sorted(((float(products[r, i]), r, i) for r in range(b) for i in range(k)
                       if (r, i) not in guaranteed and products[r, i] > 0 and products[r, i] >= threshold),
                      key=lambda x: (-x[0], x[1], x[2]))
        take = guaranteed | {(r, i) for _, r, i in rest[: max(0, budget - len(guaranteed))]}
        assert lengths == [sum((r, i) in take for i in range(k)) for r in range(b)]
        for r in range(b):  # a request's share is a prefix of its draft
            assert all((r, i) in take for i in range(lengths[r]))
    assert batch_verify_budget(torch.tensor([[0.9, 0.5], [0.8, 0.7]]), 3).tolist() == [1, 2]
    with pytest.raises(ValueError, match="non-increasing"):
        batch_verify_budget(torch.tensor([[0.2, 0.5]]), 2)
    with pytest.raises(ValueError, match="budget"):
        batch_verify_budget(torch.tensor([[0.2]]), -1)


def test_config_keys_round_trip_validate_and_registry():
    from decoder.mechanisms import REGISTRY, validate_change

    assert DecodeConfig().verify == "chain" and DecodeConfig().dcut is False  # off in stock
    cfg = _cfg(verify="tree", tree_shape="3,2,1", tree_topk=5, tree_depth=6, tree_budget=30, two_level_alts=3,
               dcut_threshold=0.25)
    assert DecodeConfig.from_toml(cfg.to_toml()) == cfg
    assert REGISTRY["tree-verify"].family == "acceptance"
    assert REGISTRY["two-level-verify"].family == "acceptance"
    assert REGISTRY["d-cut"].family == "drafting"
    validate_change({"verify": "tree", "tree_budget": 24, "dcut": True, "dcut_threshold": 0.3})
    with pytest.raises(ValueError, match="tree_budget = 1000"):
        validate_change({"tree_budget": 1000})
    for kw, needle in [
        (dict(verify="beam"), "verify = 'beam'"),
        (dict(verify="tree", tree_shape="4,x"), "tree_shape = '4,x'"),
        (dict(verify="tree", tree_shape="16,16"), "272 nodes exceed 256"),
        (dict(verify="tree", tree_budget=0), "tree_budget = 0"),
        (dict(verify="two-level", temperature=0.7), "needs temperature = 0.0"),
        (dict(dcut=True, dcut_threshold=1.0), "dcut_threshold = 1.0"),
        (dict(dcut=True, drafter="ngram"), "dcut = True"),
        (dict(dcut=True, verify="tree"), "use verify = 'chain'"),
    ]:
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            _cfg(**kw)
