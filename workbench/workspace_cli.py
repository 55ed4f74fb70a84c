"""`specpilot init | branch | force | export`: workspaces, candidate branches, token forcing, patches.

Exit status: 0 success (for `force`: lossless), 1 `force` found unexplained mismatches (`export
--kernel-test`: the patched kernels' outputs differ from stock's), 2 a usage error (one line `error: ...` on
stderr), 3 `force`: the candidate crashed or was rejected (`export --kernel-test`: the patches do not apply or
build upstream, or the bench crashed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from store import NotFound, StoreError, to_dict
from workbench.cli_util import fail, quiet_transformers, run_group
from workbench.engine_source import EngineSourceError
from workbench.export import export, record_mechanism
from workbench.forcing import force, format_report
from workbench.harness import SystemCrash
from workbench.kernel_check import upstream_kernel_test
from workbench.workspace import (
    LLAMA_CPP_DEPLOYMENTS,
    Workspace,
    WorkspaceError,
    bf16_hint,
    default_demo_path,
    init_demo,
    init_llamacpp,
    init_target,
    resolve_dtype,
)

EXIT_MISMATCH, EXIT_CRASH = 1, 3


def _workspace(args: argparse.Namespace):

    return Workspace(Path(args.workspace) if args.workspace else default_demo_path())


def _errors():

    return (WorkspaceError, StoreError, NotFound, SystemCrash, EngineSourceError)


def _batch_sizes(text: str | None) -> list[int] | None:
    """--batch-sizes 1,8 -> [1, 8] (validated with the workspace's own rule when the config is built)."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise WorkspaceError(f"--batch-sizes {text}: use comma-separated integers, e.g. 1,8") from None


def _created(ws: Workspace, what: str, as_json: bool) -> int:
    """Say a demo workspace was made: a line on stderr, its path (or JSON) on stdout; exit status 0."""
    print(f"created {what} at {ws.path} (stock {ws.stock_commit[:10]})", file=sys.stderr)
    print(json.dumps({"workspace": str(ws.path), "stock_commit": ws.stock_commit}) if as_json else ws.path)
    return 0


def _init_hybrid_demo(args: argparse.Namespace) -> int:
    """The hybrid demo deployment (a hybrid recurrent target, its draft model, the demo's code prompts) as a
    workspace, through the same path as a user's own model."""
    from decoder.models import hybrid_demo_deployment  # the model paths' module loads torch: keep it off `init`

    d = hybrid_demo_deployment()
    if not (d.target / "config.json").exists():
        return fail(f"the hybrid demo target is missing under {d.target.parent}; run `specpilot train hybrid-demo`")
    if args.prompts not in (None, "code", "prose"):
        return fail(f"init hybrid-demo: --prompts {args.prompts}: the demo has code and prose prompt sets")
    path = Path(args.path) if args.path else default_demo_path().with_name("hybrid-demo")
    quiet_transformers()
    try:
        ws = init_target(path, d.target, drafter=d.drafter, prompts=d.prompt_dir / f"{args.prompts or 'code'}.jsonl",
                         name=args.name or "hybrid-demo")
    except _errors() as e:
        return fail(str(e))
    return _created(ws, "hybrid demo workspace", args.json)


def _init_llamacpp(args: argparse.Namespace) -> int:
    """`init --engine llama.cpp --deployment demo|smollm2 [PATH]`: llama-server as the workspace's system."""
    if args.drafter is not None and args.target is None:
        return fail("init --engine llama.cpp: --drafter FILE.gguf goes with --target FILE.gguf")
    if args.target is not None and args.deployment is not None:
        return fail("init --engine llama.cpp: pass --deployment demo|smollm2 or your own --target FILE.gguf, not both")
    if args.batch_sizes not in (None, "1"):
        return fail(f"init --engine llama.cpp: --batch-sizes {args.batch_sizes}: the llama.cpp system serves one "
                    f"request at a time for now; leave --batch-sizes out")
    if args.path is not None:
        return fail("init --engine llama.cpp takes one PATH, the folder to create: `specpilot init --engine llama.cpp "
                    "--deployment smollm2 PATH`")
    deployment = None if args.target else (args.deployment or "smollm2")
    if args.target is not None and args.what is None:
        return fail("init --engine llama.cpp --target needs PATH, the folder to create")
    name = args.name or (f"{deployment}-llama.cpp" + ("" if args.prompts in (None, "code") else f"-{args.prompts}")
                         if deployment else None)
    path = Path(args.what) if args.what else default_demo_path().with_name(name)
    quiet_transformers()
    try:
        ws = init_llamacpp(path, deployment=deployment, spec_type=args.spec_type or "none",
                           prompts=args.prompts or ("code" if deployment else ""), name=name,
                           target=Path(args.target) if args.target else None,
                           drafter=Path(args.drafter) if args.drafter else None,
                           tokenizer=Path(args.tokenizer) if args.tokenizer else None,
                           with_source=args.with_source)
    except _errors() as e:
        return fail(str(e))
    return _created(ws, f"llama.cpp workspace ({deployment or ws.config.target.name}"
                        f"{', with its source' if args.with_source else ''})", args.json)


def _cmd_init(args: argparse.Namespace) -> int:
    if args.engine not in (None, "torch", "llama.cpp"):
        return fail(f"init: --engine {args.engine}: choose torch (SpecPilot's decoder, the default) or llama.cpp")
    if args.dtype is not None and (args.what != "demo" or args.target is not None or args.engine == "llama.cpp"):
        return fail(f"init: --dtype {args.dtype} goes with `specpilot init demo [PATH] --dtype auto|bfloat16|float32`")
    if args.engine == "llama.cpp":
        return _init_llamacpp(args)
    if args.deployment is not None or args.spec_type is not None or args.tokenizer is not None or args.with_source:
        return fail("init: --deployment, --spec-type, --tokenizer and --with-source go with --engine llama.cpp")
    if args.target is None and args.drafter is not None:
        return fail("init: --drafter goes with --target: `specpilot init --target DIR --drafter DIR PATH`")
    if args.target is not None:
        # `init --target DIR PATH`: the one positional is the folder to create
        if args.what is None or args.path is not None:
            return fail("init --target needs exactly one PATH, the folder to create: "
                        "`specpilot init --target DIR [--drafter DIR] [--prompts FILE] PATH`")
        quiet_transformers()
        try:
            ws = init_target(args.what, args.target, drafter=args.drafter, prompts=args.prompts, name=args.name,
                             batch_sizes=_batch_sizes(args.batch_sizes))
        except _errors() as e:
            return fail(str(e))
        c = ws.config
        visible = len((ws.path / "prompts" / "visible.jsonl").read_text().splitlines())
        hidden = len(ws.hidden_prompts_path().read_text().splitlines())
        print(f"created workspace {c.name} at {ws.path} (stock {ws.stock_commit[:10]}): target {c.target}, "
              f"{f'drafter {c.drafter}' if c.drafter else 'n-gram drafting (no --drafter)'}, "
              f"{visible} visible + {hidden} hidden prompts", file=sys.stderr)
        print(json.dumps({"workspace": str(ws.path), "stock_commit": ws.stock_commit, "name": c.name,
                          "target": str(c.target), "drafter": str(c.drafter) if c.drafter else None,
                          "visible": visible, "hidden": hidden}) if args.json else ws.path)
        return 0
    if args.what == "hybrid-demo":
        return _init_hybrid_demo(args)
    if args.what != "demo":
        what = f"init {args.what}: unknown" if args.what else "init needs what to create"
        return fail(f"{what}; use `specpilot init demo [PATH]`, `specpilot init hybrid-demo [PATH]` or, for your "
                    f"own model, `specpilot init --target DIR [--drafter DIR] [--prompts FILE] PATH`")

    try:
        dtype, note = resolve_dtype(args.dtype)
        ws = init_demo(args.path, prompts=args.prompts or "code", name=args.name,
                       batch_sizes=_batch_sizes(args.batch_sizes), dtype=dtype)
    except _errors() as e:
        return fail(str(e))
    rc = _created(ws, "demo workspace", args.json)
    hint = note or bf16_hint(ws.config.dtype)  # after what was made: the created line stays first
    if hint:
        print(hint, file=sys.stderr)
    return rc


def _cmd_branch(args: argparse.Namespace) -> int:

    try:
        ws = _workspace(args)
        if args.action == "create":
            if not args.name:
                return fail("branch create needs a NAME")
            b = ws.create_branch(args.name, base=args.base, direction=args.direction or "")
            print(json.dumps(to_dict(b)) if args.json else f"{b.name}\t{b.worktree_path}")
        elif args.action == "list":
            rows = ws.list_branches()
            if args.json:
                print(json.dumps([to_dict(b) for b in rows]))
            else:
                for b in rows:
                    print(f"{b.name}\t{b.status}\t{b.agent}\t{(b.head_commit or '')[:10]}\t{b.worktree_path}")
        elif args.action == "remove":
            if not args.name:
                return fail("branch remove needs a NAME")
            ws.remove_branch(args.name)
        elif args.action == "recover":
            done = ws.recover()
            print(json.dumps(done) if args.json else ("\n".join(done) or "nothing to recover"))
        elif args.action == "record":

            if not (args.name and args.mechanism and args.family):
                return fail("branch record needs NAME, --mechanism NAME and --family FAMILY")
            m = record_mechanism(ws, args.name, args.mechanism, args.family, args.summary or "")
            print(json.dumps(to_dict(m)) if args.json else f"mechanism {m.id} ({m.name}) recorded as candidate")
    except _errors() as e:
        return fail(str(e))
    return 0


def _cmd_force(args: argparse.Namespace) -> int:

    quiet_transformers()
    try:
        ws = _workspace(args)
        report = force(ws, args.branch, progress=not args.quiet)
    except SystemCrash as e:  # the candidate's crash is a report; this is stock's, while computing the reference
        print(f"error: force {args.branch}: stock crashed computing the reference ({e.kind}: {e.reason}); "
              f"fix the entry point or models in {ws.path / 'specpilot.toml'} (logs in {ws.state / 'logs'})",
              file=sys.stderr)
        return EXIT_CRASH
    except _errors() as e:
        return fail(str(e))
    print(json.dumps(report) if args.json else format_report(report))
    return {"keep": 0, "discard": EXIT_MISMATCH}.get(report["status"], EXIT_CRASH)


def _cmd_export(args: argparse.Namespace) -> int:

    if not (args.accepted or args.mechanism):
        return fail("export needs --accepted or --mechanism ID")
    if not (args.out or args.branch or args.upstream):
        return fail("export needs --out DIR, --upstream DIR and/or --branch NAME")
    if args.kernel_test and not args.upstream:
        return fail("--kernel-test tests the --upstream patches: add --upstream DIR")
    try:
        ws = _workspace(args)
        if args.mechanism:
            ms = [ws.memory.get_mechanism(i) for i in args.mechanism]
        else:
            ms = ws.memory.list_mechanisms(status="accepted")
        files = export(ws, ms, Path(args.out) if args.out else None, args.branch,
                       Path(args.upstream) if args.upstream else None)
    except _errors() as e:
        return fail(str(e))
    if not (args.kernel_test and args.json):  # with both: one JSON object below, the files in it
        for f in files:
            print(f)
    if args.branch:
        print(f"branch {args.branch}: stock + {len(ms)} mechanism(s)", file=sys.stderr)
    if not args.kernel_test:
        return 0
    ups = [f for f in files if f.parent == Path(args.upstream).resolve()]
    print(f"kernel test of {len(ups)} upstream patch(es) on the llama.cpp tree they came from (a build from "
          "scratch: a few minutes)...", file=sys.stderr, flush=True)
    try:
        result = upstream_kernel_test(ws, ups)
    except SystemCrash as e:
        print(f"error: upstream kernel test: {e.kind}: {e.reason}", file=sys.stderr)
        return EXIT_CRASH
    except _errors() as e:
        return fail(str(e))
    print(json.dumps({"files": [str(f) for f in files], "kernel_test": result}) if args.json else result["reason"])
    return 0 if result["ok"] else EXIT_MISMATCH


def add_parser(sub) -> None:
    i = sub.add_parser("init", help="create a workspace (git repository whose first commit is stock)",
                       usage="specpilot init demo|hybrid-demo [PATH] [--prompts code|prose] [--name NAME] [--json]\n"
                             "       specpilot init --target DIR [--drafter DIR] [--prompts FILE] [--name NAME] "
                             "[--json] PATH\n"
                             "       specpilot init --engine llama.cpp [--deployment demo|smollm2] [--spec-type T] "
                             "[--prompts code|prose] [--with-source] [--name NAME] [--json] [PATH]\n"
                             "       specpilot init --engine llama.cpp --target FILE.gguf --tokenizer DIR "
                             "--prompts FILE [--drafter FILE.gguf] [--spec-type T] [--with-source] [--json] PATH")
    i.add_argument("what", nargs="?", metavar="demo | hybrid-demo | PATH",
                   help="demo: the embedded demo deployment; hybrid-demo: a hybrid recurrent target and its "
                        "draft model; with --target: the folder to create")
    i.add_argument("path", nargs="?", help="demo: folder to create (default: $SPECPILOT_DATA_DIR/workspaces/demo)")
    i.add_argument("--target", metavar="DIR", help="your deployment: the target's local Hugging Face model directory")
    i.add_argument("--drafter", metavar="DIR",
                   help="with --target: a draft model directory sharing the target's tokenizer (stock drafts with "
                        "it; without one, with n-grams)")
    i.add_argument("--prompts", metavar="FILE",
                   help="demo: code or prose (default: code); with --target: a JSONL file (a \"text\" per line, "
                        "optional \"id\", \"domain\") or a text file, one prompt per line (default: the demo's code "
                        "prompts, if the target uses the demo's tokenizer)")
    i.add_argument("--name", help="deployment name (default: demo, demo-prose, or the target folder's name)")
    i.add_argument("--dtype", metavar="auto|bfloat16|float32",
                   help="demo: the weights' dtype of the system and stock (default auto: bfloat16 on a CPU with "
                        "native bfloat16, AMX-BF16 or AVX512-BF16; elsewhere float32, which decodes faster there)")
    i.add_argument("--batch-sizes", metavar="B,B,..",
                   help="the load the deployment serves (default 1): e.g. 1,8 makes the loop time and keep changes "
                        "at one request and at batches of 8 (written as load = {batch_sizes = [1, 8]})")
    i.add_argument("--engine", metavar="torch|llama.cpp",
                   help="the system under optimization: torch (SpecPilot's decoder, the default) or llama.cpp "
                        "(llama-server, built by `make llama-cpp`; its flags are the mechanisms)")
    i.add_argument("--deployment", metavar="|".join(LLAMA_CPP_DEPLOYMENTS),
                   help="with --engine llama.cpp: demo (the demo models as bf16 GGUFs) or smollm2 "
                        "(SmolLM2-135M-Instruct Q4_1; default)")
    i.add_argument("--tokenizer", metavar="DIR",
                   help="with --engine llama.cpp --target FILE.gguf: a Hugging Face directory with the model's "
                        "tokenizer")
    i.add_argument("--spec-type", metavar="T",
                   help="with --engine llama.cpp: stock's --spec-type (default none: llama.cpp AR), e.g. ngram-simple")
    i.add_argument("--with-source", action="store_true",
                   help="with --engine llama.cpp: carry llama.cpp's source in the workspace (engine/llama.cpp/); each "
                        "commit runs the llama-server built from it (incrementally, in the sandbox, untimed)")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_init)

    def ws_arg(p) -> None:
        p.add_argument("--workspace", help="workspace folder (default: the demo workspace)")
        p.add_argument("--json", action="store_true", help="print JSON on stdout")

    b = sub.add_parser("branch", help="candidate branches: create, list, remove, recover, record")
    b.add_argument("action", choices=("create", "list", "remove", "recover", "record"))
    b.add_argument("name", nargs="?")
    b.add_argument("--base", default="stock", help="commit, branch or tag to branch from (default: stock)")
    b.add_argument("--direction", help="what the branch explores (free text)")
    b.add_argument("--mechanism", help="record: the mechanism's name")
    b.add_argument("--family", help="record: its gap family")
    b.add_argument("--summary", help="record: one line on what it does")
    ws_arg(b)
    b.set_defaults(func=_cmd_branch)

    f = sub.add_parser("force", help="token-force a branch against stock (every position checked)")
    f.add_argument("--branch", required=True)
    f.add_argument("--quiet", action="store_true", help="no progress bars")
    ws_arg(f)
    f.set_defaults(func=_cmd_force)

    e = sub.add_parser("export", help="write mechanisms as a git format-patch series on stock")
    g = e.add_mutually_exclusive_group()
    g.add_argument("--accepted", action="store_true", help="every accepted mechanism, oldest first")
    g.add_argument("--mechanism", type=int, action="append", help="a mechanism id (repeatable)")
    e.add_argument("--out", help="folder for the patch series")
    e.add_argument("--branch", help="also keep the result as this branch of the workspace")
    e.add_argument("--kernel-test", action="store_true",
                   help="apply the --upstream patches to the upstream llama.cpp tree, build ggml there and run the "
                        "kernel test on the deployment's weights (exit 1: outputs differ, 3: does not apply/build)")
    e.add_argument("--upstream", help="folder for the engine source's part of the series, relative to the engine's "
                                      "root (`git am` on an upstream llama.cpp checkout); --with-source workspaces")
    ws_arg(e)
    e.set_defaults(func=_cmd_export)


def main(argv: list[str] | None = None) -> int:
    return run_group(sys.argv[1] if argv is None else argv[0], add_parser,
                     sys.argv[2:] if argv is None else argv[1:])


if __name__ == "__main__":
    sys.exit(main())
