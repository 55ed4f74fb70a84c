"""llama.cpp as a workspace's system (issue #19): its config contract, registry, cost model by width, and the
adapter under the real harness and sandbox.

The contract and cost-model tests need nothing built. The system tests run the real `llama-server` built by
`make llama-cpp` on the demo's GGUFs, inside the sandbox, and are skipped in one line when it is not built."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import git
import pytest

from costmodel.widths import WidthProfile, width_gaps
from decoder.config import ConfigError
from decoder.engines import llamacpp_build as build
from decoder.engines.llamacpp_config import LlamaCppConfig
from decoder.mechanisms import LLAMA_CPP_REGISTRY, contract_for
from decoder.stats import MethodEntry
from workbench.agents.base import AgentContext, AgentResult, Direction, SmokeResult
from workbench.agents.engine_patch import applicable, by_flag, library, missing
from workbench.agents.tuner import TunerAgent, candidates, mechanism_name
from workbench.cli import main
from workbench.engine_source import SOURCE_REL, added_lines, apply_patch

ENGINES = build.engines_root()  # the user's engine cache, read before conftest gives each test a private data dir


@pytest.fixture(autouse=True)
def _real_engines(monkeypatch):
    monkeypatch.setenv("SPECPILOT_ENGINES_DIR", str(ENGINES))


def _engine_ready() -> bool:
    return build.is_built() and all(build.gguf_path(m, "bf16").is_file() for m in build.DEMO_MODELS)


needs_llamacpp = pytest.mark.skipif(not _engine_ready(), reason="llama.cpp is not built (run `make llama-cpp`)")


# -- the config contract ---------------------------------------------------------------------------------------


def test_stock_passes_no_speculative_flag_and_defaults_stay_the_engines():
    cfg = LlamaCppConfig()
    assert cfg.spec_flags(None) == [] and cfg.method == "ar" and cfg.verify_width() == 1
    assert cfg.server_flags() == ["--ctx-size", "4096", "--flash-attn", "auto"]  # 0 = not passed
    ng = LlamaCppConfig(spec_type="ngram-simple", ngram_size_n=3, ngram_size_m=8, threads=2)
    assert ng.spec_flags(None) == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                   "--spec-ngram-simple-size-m", "8"]
    assert ng.verify_width() == 9 and ng.method == "sd"
    assert "--threads" in ng.server_flags()
    dm = LlamaCppConfig(spec_type="draft-simple", draft_n_max=4, draft_p_min=0.75)
    assert dm.spec_flags(Path("/m/d.gguf")) == ["--spec-type", "draft-simple", "--spec-draft-model", "/m/d.gguf",
                                                 "--spec-draft-n-max", "4", "--spec-draft-p-min", "0.75"]
    with pytest.raises(ConfigError, match="needs a draft model"):
        dm.spec_flags(None)
    # ngram-mod reads bounds and a lookup length of its own; --spec-draft-n-* would be silently ignored
    mod = LlamaCppConfig(spec_type="ngram-mod", draft_n_max=16, draft_n_min=4, ngram_size_n=12)
    assert mod.spec_flags(None) == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "16",
                                    "--spec-ngram-mod-n-min", "4", "--spec-ngram-mod-n-match", "12"]
    assert mod.verify_width() == 17 and LlamaCppConfig(spec_type="ngram-mod").verify_width() == 65


@pytest.mark.parametrize("table, words", [
    ({"spec_type": "eagle9"}, "spec_type = 'eagle9': choose one of none"),
    ({"threads": -1}, "threads = -1: use 0"),
    ({"draft_p_min": 1.5}, "draft_p_min = 1.5"),
    ({"draft_n_max": 2, "draft_n_min": 3}, "must not exceed draft_n_max = 2"),
    ({"flash_attn": "yes"}, "flash_attn = 'yes'"),
    ({"threads": "2"}, "threads = '2' should be of type int"),
    ({"bogus": 1}, "unknown key(s) bogus"),
])
def test_a_bad_config_value_is_one_line_naming_it(table, words):
    with pytest.raises(ConfigError) as e:
        LlamaCppConfig.from_table(table)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_config_round_trips_through_toml_in_schema_order(tmp_path):
    cfg = LlamaCppConfig(spec_type="ngram-map-k", ngram_min_hits=2, poll=0)
    cfg.save(tmp_path / "system.toml")
    text = (tmp_path / "system.toml").read_text()
    assert text.splitlines()[:2] == ["[decode]", 'spec_type = "ngram-map-k"']
    assert LlamaCppConfig.load(tmp_path / "system.toml") == cfg


def test_every_registry_value_is_a_valid_config_and_the_tuner_builds_candidates_from_them():
    for m in LLAMA_CPP_REGISTRY.values():
        for key, values in m.keys.items():
            for v in values:
                LlamaCppConfig(**{**m.requires, key: v})  # no ConfigError
    c = contract_for("llama.cpp")
    base = LlamaCppConfig(threads=1)
    # as Workspace.refusal on a deployment with neither a draft model nor n-gram lookup caches
    drafting = candidates(base, "drafting", [], contract=c,
                          refuse=lambda cfg: "no drafter" if cfg.spec_type == "draft-simple" or
                          cfg.lookup_cache == "corpus" and cfg.spec_type == "ngram-cache" else None)
    with_caches = candidates(base, "drafting", [], contract=c,
                             refuse=lambda cfg: "no drafter" if cfg.spec_type == "draft-simple" else None)
    assert {"spec_type": "ngram-cache", "lookup_cache": "corpus"} in [x.changes for x in with_caches]
    assert drafting and all(isinstance(x.cfg, LlamaCppConfig) for x in drafting)
    # ngram-cache alone drafts from the request's own text (the corpus mechanism's switch without its caches)
    assert {x.cfg.spec_type for x in drafting} == {"ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache"}
    assert not any(x.cfg.lookup_cache == "corpus" for x in drafting)
    assert drafting[0].changes == {"spec_type": "ngram-simple"}  # the switch alone first: the engine's defaults
    # each type at the engine's defaults is carried to the tuner's last rung whatever its rank at the short one
    assert [x.changes for x in drafting if x.defaults] == [{"spec_type": t} for t in ("ngram-simple", "ngram-map-k",
                                                                                      "ngram-mod", "ngram-cache")]
    host = candidates(base, "host-overhead", [], contract=c)
    assert {"threads"} <= {k for x in host for k in x.changes}
    assert all(x.cfg.threads != 1 or x.changes for x in host)
    assert mechanism_name({"spec_type": "ngram-mod", "draft_n_max": 8}, c).startswith("llama-ngram-mod(")
    with pytest.raises(ValueError, match="choose one of torch, llama.cpp"):
        contract_for("vllm")


# -- the cost model by width -------------------------------------------------------------------------------------


def test_width_profile_interpolates_and_finds_the_oracle_width():
    p = WidthProfile("t", {1: 10.0, 2: 12.0, 4: 30.0, 8: 32.0, 16: 64.0})
    assert p.cost(1) == 10.0 and p.cost(3) == pytest.approx(21.0) and p.cost(32) == pytest.approx(128.0)
    best, width = p.oracle(16)
    assert width == 8 and best == pytest.approx(8 * 10 / 32)
    assert p.oracle(1) == (1.0, 1) and p.oracle(2)[0] == pytest.approx(20 / 12)
    with pytest.raises(ValueError, match="width 1"):
        WidthProfile("bad", {2: 3.0})
    assert WidthProfile.from_dict(json.loads(json.dumps(p.as_dict()))) == p
    # The plausibility ceiling leaves room for engine changes down to the roofline of one forward, no more.
    roofed = WidthProfile("t", p.ms, roofline_ms=4.0)
    assert p.ceiling(16) == pytest.approx(best) and roofed.ceiling(16) == pytest.approx(best * 10.0 / 4.0)
    assert WidthProfile("t", p.ms, roofline_ms=20.0).ceiling(16) == pytest.approx(best)  # never below the oracle
    assert WidthProfile.from_dict(json.loads(json.dumps(roofed.as_dict()))) == roofed


def test_width_gaps_add_up_to_the_measured_time_and_price_the_verify_width():
    p = WidthProfile("t", {1: 10.0, 2: 12.0, 4: 30.0, 8: 32.0, 16: 64.0})
    # 2 prompts, 100 tokens, 60 decode forwards + 2 prefill; acceptance 0.5, tau 100/60: width 1 + (2/3)/0.5
    e = MethodEntry(name="base", tokens_per_s=1000.0 / 15.0, tau=100 / 60, draft_len=3, target_forwards=62,
                    new_tokens=100, acceptance_rate=0.5,
                    phase_ms_per_token={"prefill": 1.0, "draft": 0.0, "verify": 12.0, "accept": 0.0, "other": 0.0})
    bd = width_gaps(e.as_dict(), p, num_prompts=2)
    assert bd.components_sum == pytest.approx(15.0)
    parts = {g.name: g.ms_per_token for g in bd.components}
    width = 1 + (100 / 60 - 1) / 0.5
    assert parts["one-token forwards (weight reads)"] == pytest.approx(0.6 * 10.0)
    assert parts["verify width beyond one token"] == pytest.approx(0.6 * (p.cost(width) - 10.0))
    assert parts["server, HTTP and adapter"] == pytest.approx(2.0)
    assert bd.acceptance_gap.family == "drafting" and bd.acceptance_gap.ms_per_token == pytest.approx(12.0 - 4.0)
    fams = bd.as_dict()["families"]
    assert math.isclose(sum(fams.values()), 15.0 + bd.acceptance_gap.ms_per_token, rel_tol=1e-6)


# -- the system under the harness (real llama-server, real sandbox) -----------------------------------------------


@pytest.fixture(scope="module")
def demo_ws(tmp_path_factory):
    if not _engine_ready():
        pytest.skip("llama.cpp is not built (run `make llama-cpp`)")
    from workbench.workspace import init_llamacpp

    mp = pytest.MonkeyPatch()
    mp.setenv("SPECPILOT_ENGINES_DIR", str(ENGINES))
    try:
        ws = init_llamacpp(tmp_path_factory.mktemp("lc") / "ws", deployment="demo", prompt_limit=4,
                           forcing_max_new_tokens=24)
    finally:
        mp.undo()
    return ws


@needs_llamacpp
def test_init_writes_a_llamacpp_workspace(demo_ws):
    c = demo_ws.config
    assert c.engine == "llama.cpp" and c.engine_bin == build.binary("llama-server").parent
    assert c.target == build.gguf_path("target", "bf16") and c.batch_sizes == [1]
    assert LlamaCppConfig.load(demo_ws.path / "system.toml") == LlamaCppConfig(threads=1)
    assert "decoder/engines/serve_llamacpp.py" in c.protected
    assert demo_ws.contract.config is LlamaCppConfig


@needs_llamacpp
def test_the_system_runs_in_the_sandbox_serves_overrides_and_refuses_batches(demo_ws):
    from decoder.engines.llamacpp import LlamaServer, ServerSettings
    from workbench.forcing import run_system
    from workbench.harness import SystemCrash

    prompt = [int(t) for t in range(5, 40)]
    with LlamaServer(demo_ws.config.target, settings=ServerSettings(threads=1)) as direct:
        want = direct.generate(prompt, 16).tokens
    with run_system(demo_ws, demo_ws.path, "test") as sp:
        assert sp.generate(prompt, 16).tokens == want
        prof = sp.generate(prompt, 16, profile=True)
        assert prof.stats["new_tokens"] == 16 and prof.stats["phase_s"]["verify"] > 0
        ng = sp.generate(prompt, 16, config={"spec_type": "ngram-simple", "ngram_size_n": 2})
        assert len(ng.tokens) == 16
        with pytest.raises(SystemCrash, match="one request at a time"):
            sp.generate_batch([prompt, prompt], 4)


@needs_llamacpp
def test_the_width_profile_is_measured_at_the_threads_the_commit_runs(demo_ws):
    """A base that runs 2 threads is priced with forward costs measured at 2 threads (at stock's 1 thread its
    host overhead came out negative); each thread count is measured once and kept beside the others."""
    from workbench.costing import _threads_of, width_profile

    said: list[str] = []

    def say(msg, *a, **k):
        said.append(msg)

    one = width_profile(demo_ws, say)
    assert one.measured["threads"] == 1 == _threads_of(demo_ws, demo_ws.stock_commit)
    two = width_profile(demo_ws, say, threads=2)
    assert two.measured["threads"] == 2 and "2 thread(s)" in said[-1]
    n = len(said)
    assert width_profile(demo_ws, say).measured["threads"] == 1 and width_profile(demo_ws, say, 2).measured[
        "threads"] == 2
    assert len(said) == n  # both kept: nothing measured again
    saved = json.loads((demo_ws.state / "widths.json").read_text())
    assert sorted(p["key"]["threads"] for p in saved["profiles"]) == [1, 2]


@needs_llamacpp
def test_stock_forces_clean_with_llamacpps_own_margins(demo_ws):
    from workbench.forcing import force, stock_reference

    ref = stock_reference(demo_ws, progress=False)
    assert ref["noise_floor"] >= 0.0
    for row in ref["prompts"]:
        assert len(row["margins"]) == len(row["stock"]) and all(m >= 0 for m in row["margins"])
    b = demo_ws.create_branch("ngram")  # llama.cpp's own speculation, forced token by token against its AR
    wt = Path(b.worktree_path)
    LlamaCppConfig(spec_type="ngram-simple", ngram_size_n=2, threads=1).save(wt / "system.toml")
    g = demo_ws.worktree_git("ngram")
    g.add("system.toml")
    g.commit("-q", "-m", "ngram-simple")
    r = force(demo_ws, "ngram", progress=False, record=False)
    assert r["status"] == "keep", r["reason"]


@needs_llamacpp
def test_a_candidate_editing_the_adapter_is_refused_before_it_runs(demo_ws):
    b = demo_ws.create_branch("adapter")
    path = Path(b.worktree_path) / "decoder" / "engines" / "serve_llamacpp.py"
    path.write_text(path.read_text().replace("MAX_SERVERS = 2", "MAX_SERVERS = 3"))
    g = demo_ws.worktree_git("adapter")
    g.add("-A")
    g.commit("-q", "-m", "touch the protocol entry")
    assert "decoder/engines/serve_llamacpp.py" in (demo_ws.guard("adapter") or "")


@pytest.mark.parametrize("argv, words", [
    (["--deployment", "mars"], "--deployment mars: choose one of demo, smollm2"),
    (["--spec-type", "eagle9"], "--spec-type eagle9: choose one of none"),
    (["--batch-sizes", "1,8"], "serves one request at a time"),
    (["--drafter", "/x.gguf"], "--drafter FILE.gguf goes with --target FILE.gguf"),
    (["--target", "/x.gguf", "--deployment", "demo"], "not both"),
    (["--target", "/nonexistent.gguf", "--tokenizer", "/t"], "--target /nonexistent.gguf: no such file"),
])
def test_init_llamacpp_bad_values_are_one_line_exit_2(argv, words, tmp_path, capsys):
    rc = main(["init", "--engine", "llama.cpp", *argv, str(tmp_path / "ws")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and words in err and len(err.splitlines()) == 1
    assert not (tmp_path / "ws").exists()


def test_init_engine_and_deployment_flags_are_checked(tmp_path, capsys):
    assert main(["init", "--engine", "vllm", str(tmp_path / "a")]) == 2
    assert "--engine vllm: choose torch" in capsys.readouterr().err
    assert main(["init", "demo", str(tmp_path / "b"), "--deployment", "smollm2"]) == 2
    assert "go with --engine llama.cpp" in capsys.readouterr().err


def test_own_gguf_bad_inputs_are_one_line_and_leave_nothing(tmp_path, capsys):
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    ws = tmp_path / "ws"
    assert main(["init", "--engine", "llama.cpp", "--target", str(text), "--tokenizer", str(tmp_path),
                 "--prompts", str(text), str(ws)]) == 2
    assert "not a GGUF file" in capsys.readouterr().err and not ws.exists()
    gguf = tmp_path / "real.gguf"
    gguf.write_bytes(b"GGUF" + bytes(16))
    assert main(["init", "--engine", "llama.cpp", "--target", str(gguf), "--prompts", str(text), str(ws)]) == 2
    assert "needs --tokenizer DIR" in capsys.readouterr().err and not ws.exists()


@needs_llamacpp
def test_own_gguf_workspace_from_files(tmp_path, capsys):
    from decoder.models import DEMO_DIR

    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\n    return a + b\nclass Stack:\n")
    ws = tmp_path / "ws"
    rc = main(["init", "--engine", "llama.cpp", "--target", str(build.gguf_path("target", "bf16")), "--drafter",
               str(build.gguf_path("drafter", "bf16")), "--tokenizer", str(DEMO_DIR / "target"), "--prompts",
               str(prompts), "--spec-type", "draft-simple", "--json", str(ws)])
    assert rc == 0, capsys.readouterr().err
    from workbench.workspace import Workspace

    w = Workspace(ws)
    assert w.config.engine == "llama.cpp" and w.config.drafter == build.gguf_path("drafter", "bf16")
    assert LlamaCppConfig.load(ws / "system.toml").spec_type == "draft-simple"
    assert "--drafter" in w.entry_argv()


@pytest.mark.slow
@needs_llamacpp
def test_one_loop_round_on_a_llamacpp_workspace(tmp_path, monkeypatch):
    """The loop end to end on llama-server: stock and AR measured, width gaps, the tuner on llama.cpp's flags,
    every attempt forced and timed by the harness; whatever it keeps is lossless and recorded once."""
    from workbench.loop import Loop, LoopOptions
    from workbench.workspace import init_llamacpp

    ws = init_llamacpp(tmp_path / "ws", deployment="demo", prompt_limit=8, forcing_max_new_tokens=32)
    summary = Loop(ws, LoopOptions(rounds=1, agents=2, budget_minutes=25, use_global_memory=False)).run()
    rounds = summary["rounds"]
    assert rounds and rounds[0]["attempts"], summary
    assert {a["status"] for a in rounds[0]["attempts"]} <= {"keep", "discard", "crash", "rejected"}
    assert 0.9 < summary["stock_speedup"] < 1.1  # stock is llama.cpp AR: the AR reference against itself
    gaps = json.loads(next((ws.state / "gaps").glob("*.json")).read_text())["breakdown"]
    assert {"weights", "compute", "host-overhead", "drafting"} <= set(gaps["families"])
    assert (ws.state / "widths.json").exists()


def test_both_systems_read_requests_the_same_way():
    """decoder.serve and the llama.cpp adapter share the protocol reader: blank lines skipped, a line that is not
    a JSON object answered with a one-line error (it crashed the server when it was a list), quit ends it."""
    import io

    from decoder.serve import read_requests

    out = io.StringIO()
    lines = ['{"id": 1, "prompt_ids": [1]}\n', "\n", "[1, 2]\n", "not json\n", '{"op": "quit"}\n', '{"id": 9}\n']
    assert [r["id"] for r in read_requests(lines, out)] == [1]
    errors = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [e["id"] for e in errors] == [None, None]
    assert errors[0]["error"] == "bad request: a request is a JSON object"
    assert errors[1]["error"].startswith("bad request: Expecting value")


# -- engine patches: a knob upstream llama.cpp lacks ------------------------------------------------------------


def test_ngram_cache_caps_its_drafts_with_a_flag_of_the_patched_engine_only():
    cap = LlamaCppConfig(spec_type="ngram-cache", lookup_cache="corpus", draft_n_max=3)
    assert cap.spec_flags(None, Path("/c")) == ["--spec-type", "ngram-cache", "--lookup-cache-dynamic",
                                                "/c/dynamic.bin", "--lookup-cache-static", "/c/static.bin",
                                                "--spec-ngram-cache-n-max", "3"]
    assert cap.verify_width() == 4 and cap.patched_flags() == ["--spec-ngram-cache-n-max"]
    upstream = LlamaCppConfig(spec_type="ngram-cache")  # upstream's fixed 8 drafted tokens: no flag, width 9
    assert upstream.verify_width() == 9 and upstream.patched_flags() == []
    assert "--spec-ngram-cache-n-max" not in upstream.spec_flags(None)
    # the draft model's and ngram-mod's caps are upstream flags
    assert LlamaCppConfig(spec_type="draft-simple", draft_n_max=3).patched_flags() == []
    assert LlamaCppConfig(spec_type="ngram-mod", draft_n_max=3).patched_flags() == []


def _engine_repo(tmp_path: Path, with_source: bool = True):
    """A real git repository standing in for a workspace's: an engine tree without the patch's lines (`without`)
    and one with every line the library's ngram-cache patch adds (`with_`)."""
    repo = git.Repo.init(tmp_path)
    repo.git.config("user.email", "t@example.com")
    repo.git.config("user.name", "t")
    (p,) = [x for x in library() if x.name == "llama-ngram-cache-n-max"]
    files = added_lines(p.text())
    for rel in files:
        (tmp_path / SOURCE_REL / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / SOURCE_REL / rel).write_text("// upstream\n")
    repo.git.add("-A")
    repo.git.commit("-q", "-m", "upstream")
    without = repo.head.commit.hexsha
    for rel, lines in files.items():
        (tmp_path / SOURCE_REL / rel).write_text("// upstream\n" + "\n".join(lines) + "\n")
    repo.git.commit("-qam", "patched")
    ws = SimpleNamespace(repo=repo, path=tmp_path,
                         config=SimpleNamespace(engine_source=SOURCE_REL if with_source else None))
    return ws, without, repo.head.commit.hexsha


def test_a_flag_of_an_engine_patch_is_refused_where_the_engine_lacks_the_patch(tmp_path):
    flags = LlamaCppConfig(spec_type="ngram-cache", draft_n_max=3).patched_flags()
    ws, without, with_ = _engine_repo(tmp_path / "src")
    assert by_flag("--spec-ngram-cache-n-max").family == "drafting"
    assert missing(ws, with_, flags) is None and missing(ws, with_, []) is None
    why = missing(ws, without, flags)
    assert why == f"--spec-ngram-cache-n-max needs the engine patch llama-ngram-cache-n-max, which the engine " \
                  f"source at {without[:10]} lacks"
    assert missing(ws, None, flags) is None  # the commit that will carry it is not made yet: the tuner's own check
    # the tuner offers the patch to a drafting search on a base without it, and not again once carried
    assert [p.name for p in applicable(ws, without, "drafting")] == ["llama-ngram-cache-n-max"]
    assert applicable(ws, with_, "drafting") == [] and applicable(ws, without, "compute") == []
    # the real patch does not fit these stand-in files: one line of why, and the tree is left as it was
    why = apply_patch(ws.repo.git, by_flag("--spec-ngram-cache-n-max").patch)
    assert why and "\n" not in why and not ws.repo.is_dirty()
    prebuilt, _, _ = _engine_repo(tmp_path / "bin", with_source=False)
    assert "this workspace runs a prebuilt llama.cpp" in missing(prebuilt, None, flags)
    assert applicable(prebuilt, without, "drafting") == []


@pytest.mark.skipif(not build.source_dir().is_dir(), reason="llama.cpp's source is not unpacked (run `make llama-cpp`)")
def test_the_engine_patches_apply_to_the_vendored_llama_cpp(tmp_path):
    for p in library():
        for rel in added_lines(p.text()):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(build.source_dir() / rel, tmp_path / rel)
        r = subprocess.run(["git", "apply", "--check", str(p.patch)], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, f"{p.name}: {r.stderr}"


@needs_llamacpp
def test_the_tuner_keeps_an_engine_patch_only_when_its_winner_uses_the_flag(demo_ws):
    (patch,) = [p for p in library() if p.name == "llama-ngram-cache-n-max"]
    ws = demo_ws
    for name, n_max in (("uses-the-cap", 3), ("upstream-cap", 0)):
        b = ws.create_branch(name)
        wt = Path(b.worktree_path)
        g = ws.worktree_git(name)
        before = ws.head(name)
        (wt / "engine-patch.txt").write_text("stands in for the patch's commit\n")  # what the settle step reverts
        g.add("-A")
        g.commit("-q", "-m", "engine: the patch")
        LlamaCppConfig(threads=1, spec_type="ngram-cache", draft_n_max=n_max).save(wt / "system.toml")
        g.commit("-qam", "tuner (drafting): the winner")
        won = ws.head(name)
        ctx = AgentContext(name, wt, Direction("drafting", 1.0, "drafting"), [], [], lambda: SmokeResult(True, "ok"),
                           lambda *a: None, git_common_dir=Path(ws.repo.git_dir))
        res = TunerAgent(ws)._settle_engine_patches(ctx, before, [patch], AgentResult(
            True, "llama-ngram-cache: 1.10x", mechanism="llama-ngram-cache", summary="s", details={"config": {}}))
        if n_max:  # the winner passes --spec-ngram-cache-n-max: the patch stays, named in the mechanism
            assert ws.head(name) == won and res.mechanism == "llama-ngram-cache-n-max+llama-ngram-cache"
            assert res.details["engine_patches"] == ["llama-ngram-cache-n-max"]
        else:  # upstream's behaviour: the config alone on the base, the patch's commit gone
            assert ws.head(name) != won and ws.rev(f"{ws.head(name)}~1") == before
            assert not (wt / "engine-patch.txt").exists() and res.mechanism == "llama-ngram-cache"
            assert LlamaCppConfig.from_table(ws.config_at(ws.head(name))).spec_type == "ngram-cache"
