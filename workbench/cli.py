"""`specpilot`: engine commands for scripts and CI.

Errors a user can cause print one line on stderr (`error: ...`) and exit with status 2 (`bench --peers llama.cpp`
without `make llama-cpp` included). `bench --peers`: a peer engine that fails mid-run prints one line naming its
log and exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from costmodel.cli import add_parser as add_costmodel_parsers
from decoder.config import MAX_NEW_TOKENS, ConfigError, DecodeConfig
from decoder.engines import EngineError, EngineNotBuilt
from decoder.engines.smollm2 import DRAFTER_ASSET, LOOKUP_CORPUS_ASSET, ModelFetchError
from decoder.lab.peers import PeerError, PeerGroup, peer_settings
from decoder.presets import CORPUS_TREE_ALTS
from workbench.cli_util import OneLineParser, check_out_file, fail, positive_int, quiet_transformers, write_atomic
from workbench.demo_cli import add_parser as add_demo_parser
from workbench.memory_cli import add_parser as add_memory_parser
from workbench.w12_cli import add_parser as add_w12_parser
from workbench.workspace import DTYPE_AUTO, auto_dtype
from workbench.workspace_cli import add_parser as add_workspace_parsers

EXIT_ENGINE = 3  # bench --peers: a peer engine failed mid-run


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.drafter and not args.target:  # --deployment brings its own drafter; this one would be ignored
        return fail(f"--drafter {args.drafter} needs --target DIR (the target it drafts for); add --target, or "
                    f"drop --drafter to bench the {args.deployment} deployment")
    if args.dtype == DTYPE_AUTO:  # the table's header and the report's "dtype" say which it chose
        args.dtype = auto_dtype() if args.device == "cpu" else "bfloat16"
    why = check_out_file("--out", args.out) if args.out else None  # before minutes of measurement, not after
    if why:
        return fail(why)
    if args.peers:
        peers = _peer_settings(args)
        if isinstance(peers, int):
            return peers
    else:
        peers = None
    from decoder.lab.bench import (
        ALL_METHODS,
        BenchError,
        FeatureSettings,
        TreeSettings,
        bench_deployment,
        format_table,
        run_bench,
    )
    from decoder.models import ModelLoadError, demo_deployment

    quiet_transformers()

    try:
        if args.target:
            target, drafter = Path(args.target), Path(args.drafter) if args.drafter else None
            prompt_dir = demo_deployment().prompt_dir  # prompt sets are text: any tokenizer can use them
            deployment = args.target
        else:
            target, drafter, prompt_dir = bench_deployment(args.deployment)
            deployment = args.deployment
        _check_max_new_tokens(args, target, prompt_dir)
        if args.batch_sizes:
            return _batch_bench(args, target, drafter, prompt_dir, deployment)
        methods = tuple(m.strip() for m in args.methods.split(",")) if args.methods else ALL_METHODS
        feature = FeatureSettings(**{f: getattr(args, f) for f in FeatureSettings.__dataclass_fields__
                                     if getattr(args, f, None) is not None})
        DecodeConfig(lean_forward=True, drafter="routed", route_code=feature.route_code,
                     route_prose=feature.route_prose)  # names a bad route the way a config file would
        if not 64 <= feature.mtp_draft_vocab <= 262144:
            return fail(f"bench: --mtp-draft-vocab {feature.mtp_draft_vocab}: use 64 to 262144 tokens (the pruned "
                        f"heads score that many of the most frequent)")
        tree = _tree_settings(args, TreeSettings)
        with ExitStack() as stack:
            group = stack.enter_context(PeerGroup(peers)) if peers is not None else None
            report = run_bench(
                target, drafter, args.prompts, args.max_new_tokens, deployment=deployment, prompt_dir=prompt_dir,
                methods=methods, draft_len=args.draft_len, ngram_draft_len=args.ngram_draft_len,
                ngram_max=args.ngram_max, ngram_min=args.ngram_min, dtype=args.dtype,
                device=args.device, limit=args.limit, progress=not args.quiet,
                tree=tree, feature=feature,
                skip_unsupported=not args.methods,  # the default set runs what this model can; named methods must run
                peers=group,
            )
    except (BenchError, ModelLoadError, ConfigError, PeerError, EngineNotBuilt) as e:
        return fail(str(e))
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ENGINE
    if args.out:  # first: minutes of measurement are never lost to a display problem
        write_atomic(args.out, json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
    return 0


def _peer_settings(args: argparse.Namespace):
    """PeerSettings for `bench --peers`, or the exit status of a one-line error (checked before any model loads:
    a missing llama.cpp build says to run `make llama-cpp`)."""
    if args.batch_sizes:
        return fail("--peers: not with --batch-sizes (llama.cpp runs one request at a time here); drop one")
    if args.target:
        return fail(f"--peers: GGUFs exist for --deployment demo and smollm2 only, not --target {args.target}; "
                    f"drop --peers")
    names = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    types = (tuple(t.strip() for t in args.peer_spec_types.split(",") if t.strip())
             if args.peer_spec_types else None)
    try:
        return peer_settings(names, args.deployment, args.dtype, types, args.draft_len)
    except (PeerError, EngineNotBuilt) as e:
        return fail(str(e))


def _check_max_new_tokens(args: argparse.Namespace, target: Path, prompt_dir: Path | None) -> None:
    """Refuse a --max-new-tokens the target cannot hold before any model loads (a BenchError naming the most it
    can): the longest prompt plus the new tokens must fit in its max_position_embeddings."""
    from decoder.lab.bench import BenchError, load_prompts
    from decoder.models import load_tokenizer, max_positions

    n = args.max_new_tokens
    if n > MAX_NEW_TOKENS:
        raise BenchError(f"--max-new-tokens {n}: use at most {MAX_NEW_TOKENS} (and fewer than the target's "
                         f"positions)")
    limit = max_positions(target)
    if limit is None:  # the config does not say; MAX_NEW_TOKENS still bounds the run
        return
    prompts = load_prompts(args.prompts, prompt_dir)[1][: args.limit]
    tok = load_tokenizer(target, "target")
    longest = max(len(tok(p.text, add_special_tokens=False)["input_ids"]) for p in prompts)
    if longest + n > limit:
        fix = f"use at most {limit - longest}" if limit > longest else "use shorter prompts"
        raise BenchError(f"--max-new-tokens {n}: the longest prompt has {longest} tokens and target {target} "
                         f"holds {limit} positions (max_position_embeddings); {fix}")


def _batch_bench(args: argparse.Namespace, target: Path, drafter: Path | None, prompt_dir: Path | None,
                 deployment: str) -> int:
    """`bench --batch-sizes`: batched AR against batched SD with the batching mechanisms on and off."""
    from decoder.lab.batch_bench import BATCH_DRAFTERS, format_batch_table, parse_batch_sizes, run_batch_bench

    drafters = tuple(d.strip() for d in args.batch_drafters.split(",")) if args.batch_drafters else BATCH_DRAFTERS
    methods = tuple(m.strip() for m in args.batch_methods.split(",") if m.strip()) if args.batch_methods else ()
    if methods and not args.batch_drafters:
        drafters = ()  # the named methods (and batched AR) only
    elif drafter is None and not args.batch_drafters:
        drafters = ("ngram",)
    report = run_batch_bench(
        target, drafter, args.prompts, args.max_new_tokens, parse_batch_sizes(args.batch_sizes),
        deployment=deployment, prompt_dir=prompt_dir, drafters=drafters, draft_len=args.draft_len,
        ngram_draft_len=args.ngram_draft_len, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
        dtype=args.dtype, device=args.device, limit=args.limit, progress=not args.quiet, repeats=args.repeats,
        methods=methods, drafters_root=Path(args.drafters) if args.drafters else None, schedule=args.batch_schedule,
    )
    if args.out:  # first: minutes of measurement are never lost to a display problem
        write_atomic(args.out, json.dumps(report, indent=2))
    print(json.dumps(report) if args.json else format_batch_table(report))
    return 0


def _tree_settings(args: argparse.Namespace, cls):
    """TreeSettings from the --tree-*/--two-level-*/--dcut-* flags (unset flags keep the defaults)."""

    defaults = cls()
    kw = {f: getattr(args, f) for f in defaults.__dataclass_fields__ if getattr(args, f, None) is not None}
    settings = cls(**kw)
    # Let DecodeConfig name a bad value the way a config file would.
    DecodeConfig(lean_forward=True, verify="tree", tree_shape=settings.tree_shape, tree_topk=settings.tree_topk,
                 tree_depth=settings.tree_depth, tree_budget=settings.tree_budget,
                 two_level_alts=settings.two_level_alts, dcut_threshold=settings.dcut_threshold)
    return settings


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from decoder.lab.train_drafter import (
        DrafterSpec,
        read_answers,
        train_corpus_index,
        train_feature_drafter,
        train_lookup_corpus,
        train_router,
        train_vocab_rank,
    )
    from decoder.models import DEMO_DIR, ModelLoadError, check_model_dir, smollm2_deployment

    if args.kind is None:
        return fail("train drafter: --kind is required (block, mtp, router, vocab, corpus or lookup-cache)")
    try:
        target = smollm2_deployment().target if args.target == "smollm2" else \
            Path(args.target) if args.target else DEMO_DIR / "target"
        check_model_dir(target, "target")
    except ModelLoadError as e:
        return fail(str(e))
    answers = Path(args.answers) if args.answers else None
    if args.kind == "lookup-cache" and answers is None:
        return fail("train drafter: --kind lookup-cache needs --answers FILE (a chat deployment's own answers, e.g. "
                    "`specpilot train smollm2-drafter --only data`'s answers.jsonl)")
    if answers is not None and (args.kind not in ("block", "mtp", "vocab", "corpus", "lookup-cache")
                                or not answers.is_file()):
        return fail(f"train drafter: --answers {answers}: " + (
            "not a file; give a JSONL of \"prompt\" and \"tokens\" rows (e.g. `specpilot train smollm2-drafter "
            "--only data`'s answers.jsonl)" if args.kind != "router" else
            "only for --kind block, mtp, vocab, corpus or lookup-cache"))
    if answers is not None:
        try:  # a bad row is named before the target loads
            read_answers(answers)
        except (ValueError, OSError) as e:
            return fail(f"train drafter: {e}")
    if args.kind == "lookup-cache":
        out = Path(args.out) if args.out else (LOOKUP_CORPUS_ASSET if args.target == "smollm2"
                                               else target / "drafters" / "lookup-corpus.npz")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(out.parent, os.W_OK):
                return fail(f"train drafter: cannot write {out.parent}: not writable; give --out a writable path")
            print(json.dumps(train_lookup_corpus(target, answers, out)))
        except ValueError as e:
            return fail(f"train drafter: {e}")
        except OSError as e:
            return fail(f"train drafter: cannot write {e.filename or out}: {e.strerror or e}; give --out a writable "
                        f"path")
        return 0
    if args.kind in ("router", "vocab", "corpus"):
        out = Path(args.out) if args.out else None
        if args.kind == "corpus" and args.train_sequences is not None and args.train_sequences < 0:
            return fail(f"train drafter: --train-sequences {args.train_sequences} must be 0 or more")
        if args.kind == "corpus":  # minutes of work go to this file: refuse a folder that cannot take it first
            folder = (out or target / "drafters" / "corpus.npz").parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                return fail(f"train drafter: cannot write {folder}: {e.strerror or e}; give --out a writable path")
            if not os.access(folder, os.W_OK):
                return fail(f"train drafter: cannot write {folder}: not writable; give --out a writable path")
        try:
            if args.kind == "router":
                print(json.dumps(train_router(target, out, seed=args.seed)))
            elif args.kind == "vocab":
                print(json.dumps(train_vocab_rank(target, out, answers=answers, seed=args.seed)))
            else:
                n = 8192 if args.train_sequences is None else args.train_sequences
                print(json.dumps(train_corpus_index(target, out, answers=answers, self_sequences=n, seed=args.seed,
                                                    work=Path(args.work_dir) if args.work_dir else None)))
        except ValueError as e:
            return fail(f"train drafter: {e}")
        except OSError as e:
            return fail(f"train drafter: cannot write {e.filename or args.out}: {e.strerror or e}; give --out a "
                        f"writable path")
        return 0
    # The committed demo recipe: block 3500 steps; MTP 6 heads, 8000 steps (cheap per step).
    spec = DrafterSpec(kind=args.kind, seed=args.seed, steps=3500 if args.kind == "block" else 8000,
                       num_heads_mtp=6)
    if answers is not None:  # chat rows: a prompt of up to 128 tokens, then the answer (the bench's 128 tokens)
        spec.answers, spec.prefix_len, spec.gen_len = str(answers.resolve()), 128, 128
    for key in ("steps", "train_sequences", "batch_size", "block_size", "num_layers", "lr"):
        v = getattr(args, key)
        if v is not None:
            if v <= 0:
                return fail(f"train drafter: --{key.replace('_', '-')} {v} must be positive")
            setattr(spec, key, v)
    if args.heads is not None:
        if not 1 <= args.heads <= 16:
            return fail(f"train drafter: --heads {args.heads}: use 1 to 16")
        spec.num_heads_mtp = args.heads
    if args.target_layers:
        try:
            spec.target_layers = tuple(int(x) for x in args.target_layers.split(","))
        except ValueError:
            return fail(f"train drafter: --target-layers {args.target_layers!r}: use comma-separated layer "
                        f"indices, e.g. 1,3,5")
    work = Path(args.work_dir) if args.work_dir else Path("build/train-drafter")
    out = Path(args.out) if args.out else None
    if args.force:

        (work / f"{spec.kind}-s{spec.seed}.ckpt.pt").unlink(missing_ok=True)
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
    try:
        recipe = train_feature_drafter(target, out, work, spec)
    except ValueError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"train drafter: {e.filename or work}: {e.strerror}; pass a writable --work-dir/--out")
    print(json.dumps({"kind": spec.kind, "parameters": recipe["parameters"], "train_seconds": recipe["train_seconds"],
                      "data_seconds": recipe["data_seconds"], "val": recipe["val"]}))
    return 0


def _cmd_train_hybrid(args: argparse.Namespace) -> int:
    from decoder.lab.train import train_hybrid_demo
    from decoder.models import DEMO_DIR, HYBRID_DEMO_DIR

    out = Path(args.out) if args.out else HYBRID_DEMO_DIR
    work = Path(args.work_dir) if args.work_dir else Path("build/train-hybrid")
    if args.force:
        shutil.rmtree(out / "target", ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    results = train_hybrid_demo(out, work, DEMO_DIR)
    print(json.dumps({k: {"parameters": v["parameters"], "final_val_loss": v["final_val_loss"]}
                      for k, v in results.items()}))
    return 0


def _cmd_train_smollm2_drafter(args: argparse.Namespace) -> int:
    given = {}
    for key in ("steps", "batch_size", "lr", "instructions"):
        v = getattr(args, key)
        if v is not None:
            if v <= 0:
                return fail(f"train smollm2-drafter: --{key.replace('_', '-')} {v} must be positive")
            given[key] = v
    if args.num_layers is not None:
        if not 1 <= args.num_layers <= 8:
            return fail(f"train smollm2-drafter: --num-layers {args.num_layers}: use 1 to 8")
        given["num_layers"] = args.num_layers
    server = Path(args.engine_server) if args.engine_server else None
    if server is not None and not (server.is_file() and os.access(server, os.X_OK)):
        return fail(f"train smollm2-drafter: --engine-server {server}: not an executable file; give a llama-server "
                    "binary (or leave it out for make llama-cpp's)")
    from decoder.lab.smollm2_drafter import SmolDrafterSpec, train_smollm2_drafter  # torch: after the checks

    spec = SmolDrafterSpec(seed=args.seed, **given)
    work = Path(args.work_dir) if args.work_dir else Path("build/train-smollm2-drafter")
    out = Path(args.out) if args.out else DRAFTER_ASSET
    try:
        if args.force:  # retrain; the data (instructions, answers) is kept
            for ckpt in ("drafter.ckpt", "drafter-stage2.ckpt"):
                (work / ckpt).unlink(missing_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        recipe = train_smollm2_drafter(work, out, spec, server, data_only=args.only == "data")
    except (ModelFetchError, EngineError) as e:
        return fail(f"train smollm2-drafter: {e}")
    except OSError as e:
        return fail(f"train smollm2-drafter: {e.filename or work}: {e.strerror}; pass a writable --work-dir/--out")
    if args.only == "data":
        print(json.dumps(recipe))
        return 0
    print(json.dumps({"parameters": recipe["parameters"], "train_answers": recipe["train_answers"],
                      "data_seconds": recipe["data_seconds"], "train_seconds": recipe["train_seconds"],
                      "evaluation": recipe["evaluation"], "out": str(out)}))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    allowed = {"demo": ("target", "drafter"), "smollm2-drafter": ("data",)}.get(args.what, ())
    if args.only is not None and args.only not in allowed:
        return fail(f"train {args.what}: --only {args.only}: " + (
            f"use {' or '.join(allowed)}" if allowed else "this recipe runs as one stage; leave --only out"))
    if args.what == "drafter":
        return _cmd_train_drafter(args)
    if args.what == "smollm2-drafter":
        return _cmd_train_smollm2_drafter(args)
    if args.what == "hybrid-demo":
        return _cmd_train_hybrid(args)
    if args.what != "demo":
        return fail(f"train {args.what}: unknown; available: demo, hybrid-demo, drafter, smollm2-drafter")
    from decoder.lab.train import train_demo
    from decoder.models import DEMO_DIR

    out = Path(args.out) if args.out else DEMO_DIR
    work = Path(args.work_dir) if args.work_dir else Path("build/train-demo")
    if args.force:

        for sub in ("target", "drafter", "tokenizer"):
            shutil.rmtree(out / sub, ignore_errors=True)
        # Checkpoints would otherwise resume the old run to its end; the token cache follows the tokenizer.
        shutil.rmtree(work, ignore_errors=True)
    results = train_demo(out, work, only=args.only)
    summary = {k: {"parameters": v["parameters"], "final_val_loss": v["final_val_loss"]}
               for k, v in results.items() if k != "quality"}
    if "quality" in results:
        summary["mean_repeated_4gram_fraction"] = results["quality"]["mean_repeated_4gram_fraction"]
    print(json.dumps(summary))
    return 0


# The bench's flags for its feature and tree methods, one per FeatureSettings / TreeSettings field (the flag is the
# field's name with dashes; unset, the field keeps its default): field -> (type, help).
SETTINGS_FLAGS: dict[str, tuple[Callable[[str], object] | None, str]] = {
    "block_draft_len": (positive_int, "sd-block: tokens drafted per block (default 8)"),
    "mtp_draft_len": (positive_int, "sd-mtp: tokens drafted by the heads (default 6)"),
    "mtp_draft_vocab": (positive_int, "sd-mtp-vocab: the most frequent tokens its pruned heads score (default "
                                      "1024; 64 or more)"),
    "mtp_tree_alts": (positive_int, "sd-mtp-tree-dnn: each head's next tokens beside the chain (default 2; up to 8)"),
    "corpus_tree_alts": (positive_int, "sd-corpus-tree-fused: chain nodes with a datastore branch beside them "
                                       f"(default {CORPUS_TREE_ALTS}; up to 8)"),
    "route_code": (None, "sd-routed: drafter for code prompts (block, mtp, draft-model, ngram; default mtp)"),
    "route_prose": (None, "sd-routed: drafter for prose prompts (default mtp)"),
    "drafters": (None, "the target's feature drafters directory (default TARGET/drafters)"),
    "tree_shape": (None, "sd-tree: 'dynamic' or children per depth, e.g. 4,2,1,1"),
    "tree_topk": (positive_int, "sd-tree (dynamic): nodes expanded per depth, children each"),
    "tree_depth": (positive_int, "sd-tree (dynamic): depth"),
    "tree_budget": (positive_int, "sd-tree (dynamic): nodes the target verifies per step"),
    "two_level_alts": (positive_int, "sd-two-level: alternatives held per chain position"),
    "two_level_draft_len": (positive_int, "sd-two-level: chain length k"),
    "dcut_threshold": (float, "sd-dcut: cut where the product of top-1 probs < this"),
    "dcut_max_len": (positive_int, "sd-dcut: longest draft"),
}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="specpilot", description="SpecPilot engine commands.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    b = sub.add_parser("bench", help="benchmark AR, our SD and Hugging Face generate on the same prompts")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--deployment", default="demo",
                     help="a named deployment: demo, hybrid-demo (a hybrid recurrent target), or smollm2 "
                     "(SmolLM2-135M-Instruct, fetched and dequantised once; chat prompts) (default: demo)")
    src.add_argument("--target", help="a local Hugging Face model directory to use as target")
    b.add_argument("--drafter", help="draft model directory (with --target)")
    b.add_argument("--prompts", default="code", help="code, prose, or a .jsonl file of {id, text} rows")
    b.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help="tokens generated per prompt (default 128); the longest prompt plus these must fit the "
                        "target's max_position_embeddings, and at most 65536")
    b.add_argument("--draft-len", type=positive_int, default=3, help="draft model tokens per step (k)")
    b.add_argument("--ngram-draft-len", type=positive_int, default=8, help="n-gram drafter tokens per step")
    b.add_argument("--ngram-max", type=positive_int, default=4, help="longest suffix the n-gram drafter matches")
    b.add_argument("--ngram-min", type=positive_int, default=1, help="shortest suffix it accepts")
    b.add_argument("--methods", help="comma-separated subset of methods (hf-greedy is always run)")
    for name, (kind, text) in SETTINGS_FLAGS.items():
        b.add_argument("--" + name.replace("_", "-"), type=kind, help=text)
    b.add_argument("--limit", type=positive_int, help="use only the first N prompts")
    b.add_argument("--dtype", default=DTYPE_AUTO, choices=(DTYPE_AUTO, "bfloat16", "float32", "float16"),
                   help="the models' dtype (default auto: on a CPU without native bfloat16, no AMX-BF16 or "
                        "AVX512-BF16, float32, which is faster there and checked strictly; else bfloat16)")
    b.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    b.add_argument("--batch-sizes", help="batched AR vs batched SD at these batch sizes (e.g. 1,4,8,16), each "
                   "batching mechanism on and off, instead of the single-request methods")
    b.add_argument("--batch-drafters", help="with --batch-sizes: draft-model, ngram or both (default: both)")
    b.add_argument("--batch-methods", help="with --batch-sizes: bench methods to run batched against batched AR "
                   "(e.g. sd-tree,sd-two-level,sd-dcut,sd-mtp); alone, instead of the drafter x mechanism grid")
    b.add_argument("--batch-schedule", action="store_true",
                   help="with --batch-sizes: per drafter, choose the draft length per batch size from measurements "
                        "(0 = AR steps; speculation only 3%% ahead of AR), key each by the live requests that batch "
                        "reaches, and run that load_schedule against batched AR, instead of the mechanism grid")
    b.add_argument("--repeats", type=positive_int, default=1,
                   help="with --batch-sizes: runs per configuration, interleaved; the fastest is kept")
    b.add_argument("--peers", help="other engines in the same interleaved run: llama.cpp (build it with `make "
                   "llama-cpp`; --deployment demo or smollm2): its AR and every speculative type that runs, each with "
                   "ratio_vs_llama_cpp_ar and checked against llama.cpp AR's output")
    b.add_argument("--peer-spec-types", help="with --peers llama.cpp: only these --spec-type values (e.g. "
                   "draft-simple,ngram-simple; default: every type that runs for the deployment)")
    b.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    b.add_argument("--out", help="also write the JSON report to this file")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=_cmd_bench)


    add_costmodel_parsers(sub)  # `costmodel` and `profile`


    add_memory_parser(sub)  # `memory list|show|search|accept|reject`


    add_workspace_parsers(sub)  # `init`, `branch`, `force`, `export`

    add_w12_parser(sub)  # `w12 stats`


    add_demo_parser(sub)  # `demo`

    t = sub.add_parser("train", help="train models by the project's own recipes")
    t.add_argument("what", choices=("demo", "hybrid-demo", "drafter", "smollm2-drafter"),
                   help="demo: tokenizer, target and draft model of the embedded demo; hybrid-demo: the hybrid "
                        "recurrent target distilled from the demo target; drafter: a block "
                        "drafter, MTP heads or the domain router for a target (self-distilled); smollm2-drafter: "
                        "a draft model for SmolLM2-135M-Instruct distilled from its own answers (needs "
                        "`make llama-cpp`)")
    t.add_argument("--out", help="output (demo: root, default the package's demo assets; drafter: its "
                                 "directory, default TARGET/drafters/KIND, router: TARGET/drafters/router.json)")
    t.add_argument("--work-dir", help="checkpoints and caches (default: build/train-demo, build/train-drafter)")
    t.add_argument("--kind", choices=("block", "mtp", "router", "vocab", "corpus", "lookup-cache"),
                   help="drafter: what to train (vocab: the token frequency ranking a pruned drafter head uses; "
                        "corpus: the datastore of drafter = 'corpus', from the corpus and the target's own "
                        "continuations; lookup-cache: the corpus of llama.cpp's n-gram lookup caches from --answers, "
                        "default out for smollm2 the committed decoder/assets/smollm2/lookup/answers.npz)")
    t.add_argument("--target", help="drafter: the target's local model directory, or smollm2 (default: the demo "
                                    "target)")
    t.add_argument("--answers", metavar="FILE",
                   help="drafter (block, mtp): distil on a chat deployment's own answers (JSONL rows with \"prompt\" "
                        "and \"tokens\", e.g. `train smollm2-drafter --only data`'s WORK/answers.jsonl) instead of "
                        "corpus continuations; vocab: rank tokens by their counts in those answers")
    t.add_argument("--seed", type=int, default=0, help="drafter: seed of data order and initialisation")
    t.add_argument("--steps", type=int, help="drafter: optimiser steps (default: block 3500, mtp 8000)")
    t.add_argument("--train-sequences", type=int,
                   help="drafter: greedy sequences to distil on (default 4096); corpus: the target's continuations "
                        "it indexes per domain (default 8192; 0: none)")
    t.add_argument("--batch-size", type=int, help="drafter: sequences per step (default 16)")
    t.add_argument("--block-size", type=int, help="block: draft slots per block (default 8)")
    t.add_argument("--num-layers", type=int, help="block: drafter layers (default 1); smollm2-drafter: (default 2)")
    t.add_argument("--instructions", type=int, help="smollm2-drafter: instructions to answer (default 2400)")
    t.add_argument("--engine-server", metavar="PATH",
                   help="smollm2-drafter: the llama-server binary that makes the data (default: make llama-cpp's; "
                        "e.g. a workspace's build with a kernel patch)")
    t.add_argument("--heads", type=int, help="mtp: number of heads (default 6)")
    t.add_argument("--lr", type=float, help="drafter: peak learning rate")
    t.add_argument("--target-layers", help="drafter: target layers to read, e.g. 1,3,5 (default: spread, ending last)")
    t.add_argument("--only", choices=("target", "drafter", "data"),
                   help="demo: run one stage (target, drafter); smollm2-drafter: make the data only (data)")
    t.add_argument("--force", action="store_true", help="retrain even if the outputs exist")
    t.set_defaults(func=_cmd_train)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
