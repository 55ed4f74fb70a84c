"""Bench methods are DecodeConfig presets: the bench and a workspace running the same preset give the same
tokens and the same tau."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import needs_demo

from decoder.config import DecodeConfig, verify_width
from decoder.featdraft import FeatureHeads, drafters_dir
from decoder.lab.bench import Bench, FeatureSettings, TreeSettings
from decoder.models import DEMO_DIR
from decoder.presets import NGRAM_DRAFT_LEN, PRESETS, preset_config
from workbench.workspace import init_demo

HAVE_FEATURE = (drafters_dir(DEMO_DIR / "target") / "mtp" / "config.json").exists()
N_TOKENS = 16  # per prompt: every compared method takes a few draft/verify steps, in both processes
COMPARED = ("sd-draft-model-lean", "sd-ngram-lean", "sd-tree", "sd-two-level", "sd-dcut",
            *(("sd-block", "sd-mtp") if HAVE_FEATURE else ()))


def test_presets_are_valid_configs_and_widths_follow_them():
    base = DecodeConfig()
    for name in PRESETS:
        preset_config(name, base)  # validates
    assert verify_width(preset_config("ar-lean", base)) == 1
    assert verify_width(preset_config("sd-two-level", base)) == 1 + base.draft_len * (1 + base.two_level_alts)
    assert verify_width(preset_config("sd-tree", base)) == 1 + base.tree_budget
    assert verify_width(preset_config("sd-tree", base, tree_shape="2,1")) == 1 + 4
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("sd-medusa", base)
    # The bench's flag defaults are DecodeConfig's: `verify = "two-level"` alone runs what sd-two-level runs.
    assert TreeSettings().two_level_alts == base.two_level_alts
    assert TreeSettings().dcut_threshold == base.dcut_threshold


@needs_demo
def test_bench_and_workspace_run_the_same_preset_to_the_same_tokens_and_tau(demo_bf16, demo_prompts, tmp_path):
    target, drafter = demo_bf16
    base = DecodeConfig(max_new_tokens=N_TOKENS)
    heads = FeatureHeads(drafters_dir(DEMO_DIR / "target"), target.config, target.dtype, target.device)
    bench = Bench(target, drafter, target.config.eos_token_id, base, NGRAM_DRAFT_LEN, tree=TreeSettings(),
                  feature=FeatureSettings(), heads=heads)
    runners = bench.methods(COMPARED)
    prompts = demo_prompts[:2]
    ours = {name: [runners[name](p) for p in prompts] for name in COMPARED}

    ws = init_demo(tmp_path / "ws", prompt_limit=6)
    # The workspace's system.toml holds sd-two-level's config; the others arrive as per-request configs.
    bench.config("sd-two-level").save(ws.path / ws.config.config_file)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ws.path)}
    proc = subprocess.Popen(ws.entry_argv(), cwd=ws.path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert json.loads(proc.stdout.readline())["ready"]
        for name in COMPARED:
            over = {} if name == "sd-two-level" else bench.config(name).as_dict()
            for i, p in enumerate(prompts):
                req = {"id": i, "prompt_ids": p, "max_new_tokens": N_TOKENS, "profile": True, "config": over}
                proc.stdin.write(json.dumps(req) + "\n")
                proc.stdin.flush()
                ans = json.loads(proc.stdout.readline())
                tokens, stats = ours[name][i]
                assert ans.get("tokens") == tokens, (name, i, ans.get("error"))
                tau = ans["stats"]["new_tokens"] / ans["stats"]["target_forwards"]
                assert tau == pytest.approx(stats.tau), name
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        ws.close()
