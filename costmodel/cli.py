"""`specpilot costmodel` and `specpilot profile hardware`.

Wire both into the main parser with `add_parser(subparsers)`; each sets `func(args) -> int`.
Errors a user can meet are ValueErrors with a one-line message; the handlers print them as
`error: ...` on stderr and return 2, like the rest of the CLI.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from costmodel.accuracy import AccuracyError, StepSweep, sweep_mismatch
from costmodel.deployment import DEMO_CONTEXT, DEMO_DRAFT_LEN, CostDeployment, demo_deployment, demo_dir
from costmodel.entry import MethodEntry
from costmodel.hardware import LOCAL, get_profile, local_profile_path, save_profile
from costmodel.kernels import WIDTHS as KERNEL_WIDTHS
from costmodel.kernels import KernelBenchError, kernel_profile_report, plot_kernel_widths
from costmodel.model_profile import WEIGHT_FORMATS, load_model_profile
from costmodel.report import build_report, format_table, plot_gaps
from costmodel.step import DRAFTER_KINDS, Drafter
from decoder.engines.smollm2 import GGUF_NAME, smollm2_dir
from workbench.gate import measurement_lock

if TYPE_CHECKING:
    from costmodel.deployment import CostDeployment

EXIT_USAGE = 2
EXIT_ENGINE = 3  # --kernels: the engine's kernel bench cannot be built or run
STEP_SWEEP_SECONDS = 4.0  # `costmodel --deployment demo`'s own step measurement, when the profile has none
PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a plain file stem: no '/', no leading '.'


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def _nonnegative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be 0 or more")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{v} must be positive")
    return v


def add_parser(subparsers) -> None:
    """Add the `costmodel` and `profile` subcommands to an argparse subparsers object."""

    c = subparsers.add_parser("costmodel", help="roofline ceilings and a ranked gap breakdown for a deployment")
    c.add_argument("--deployment", help="a named deployment: demo (its models on this machine's cpu-local profile)")
    c.add_argument("--hardware", help="h100-sxm, h200, b200, a100-80gb, l40s, rtx-4090, or cpu-local (measured)")
    c.add_argument("--target-config", help="qwen3-8b, llama-3.1-8b, qwen3-30b-a3b, qwen3-next-80b-a3b, or a "
                                           "config.json / model directory")
    c.add_argument("--drafter-config", help="the drafter's config (name, config.json or model directory)")
    c.add_argument("--drafter-kind", choices=DRAFTER_KINDS,
                   help="model: k one-token forwards; block: one forward drafts k; ngram: host lookup "
                        "(default: model with --drafter-config, else ngram)")
    c.add_argument("--drafter-layers", type=_positive_int,
                   help="keep only the drafter config's first N layers (a block drafter shaped like its target)")
    c.add_argument("--draft-len", type=_positive_int, help="drafted tokens per step, k (default 4)")
    c.add_argument("--tau", type=float, help="tokens per step, mean accepted + 1 (default: the bench's, or oracle)")
    c.add_argument("--batch", type=_positive_int, help="requests per step, B (default 1)")
    c.add_argument("--context", type=_nonnegative_int, help="tokens already in each request's KV cache")
    c.add_argument("--format", choices=tuple(WEIGHT_FORMATS), help="weight format (default bf16)")
    c.add_argument("--bench", help="a `specpilot bench --json` report: split its measured time per token")
    c.add_argument("--method", default="sd-draft-model", help="which method of --bench to break down")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.add_argument("--plot", help="also write a PNG chart of the gaps against the ceiling")
    c.add_argument("--steps-seconds", type=_positive_float, default=STEP_SWEEP_SECONDS,
                   help="with --deployment demo and no step sweep in the profile: the time budget of the short "
                        f"measurement prediction_error scores (default {STEP_SWEEP_SECONDS:g})")
    c.add_argument("--kernels", metavar="MODEL",
                   help="rank the engine's matmul kernels against their roofline: a GGUF file, or smollm2 "
                        "(llama.cpp's CPU kernels from `make llama-cpp`, measured here at --widths)")
    c.add_argument("--threads", type=_positive_int, default=1, help="--kernels: threads (default 1)")
    c.add_argument("--widths", type=_widths, default=KERNEL_WIDTHS,
                   help="--kernels: tokens per forward to measure, e.g. 1,2,4,8,16 (default 1,2,3,4,6,8,12,16)")
    c.set_defaults(func=cmd_costmodel)

    p = subparsers.add_parser("profile", help="measure this machine: `profile hardware [--model DIR]`")
    p.add_argument("what", help="hardware: bandwidth, matmul throughput and per-forward overhead of this machine")
    p.add_argument("--model", help="a local Hugging Face model directory: time its verify forwards and fit "
                                   "the overheads to them (default: the demo target, when trained)")
    p.add_argument("--drafter", help="a draft model's directory: time its one-token forward for the cost model's "
                                     "prediction error (default: the demo drafter with the demo target)")
    p.add_argument("--no-model", action="store_true", help="measure the machine only, no model sweep")
    p.add_argument("--seconds", type=_positive_float, default=10.0, help="time budget (default 10)")
    p.add_argument("--context", type=_positive_int, default=256, help="KV context of the model sweep")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the model sweep's dtype (default bfloat16); a float32 profile under the default name is "
                        "kept beside the bfloat16 one, as cpu-local-float32 (where the loop keeps a float32 "
                        "workspace's)")
    p.add_argument("--name", default=LOCAL, help=f"profile name (default {LOCAL})")
    p.add_argument("--out", help="write the profile to this file instead of the data dir")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=cmd_profile)


def _widths(text: str) -> tuple[int, ...]:
    try:
        ws = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of widths, e.g. 1,2,4,8") from None
    if not ws or any(not 1 <= w <= 64 for w in ws):
        raise argparse.ArgumentTypeError(f"{text!r}: every width must be 1-64")
    return tuple(sorted(set(ws)))


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _read_bench(path: str, method: str) -> tuple[dict, MethodEntry, float | None]:
    """(the report, the method's entry, AR ms per token or None) from a bench JSON file."""
    try:
        report = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--bench {path}: cannot read it ({e.strerror}); pass the file `specpilot bench --json "
                         f"--out FILE` wrote") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"--bench {path}: not valid JSON ({e.msg}); pass the output of `specpilot bench --json`") \
            from e
    rows = report.get("methods") if isinstance(report, dict) else None
    methods = {e.name: e for e in map(MethodEntry.from_dict, rows if isinstance(rows, list) else [])}
    if method not in methods:
        raise ValueError(f"--method {method}: not in {path}; it has {', '.join(map(str, methods)) or 'no methods'}")
    ar = methods.get("ar")
    ar_ms = 1000.0 / ar.tokens_per_s if ar and ar.tokens_per_s else None
    return report, methods[method], ar_ms


def build_deployment(args: argparse.Namespace, bench_entry: MethodEntry | None = None,
                     bench_dtype: str | None = None) -> CostDeployment:
    """The CostDeployment the flags describe (the demo's defaults, then each explicit flag)."""

    fmt = args.format or {"bfloat16": "bf16", "float32": "fp32"}.get(bench_dtype or "", "bf16")
    k = args.draft_len or (bench_entry.draft_len if bench_entry else None) or DEMO_DRAFT_LEN
    if args.deployment:
        if args.deployment != "demo":
            raise ValueError(f"--deployment {args.deployment}: unknown; use demo, or --hardware NAME --target-config "
                             f"NAME")
        base = demo_deployment(args.hardware or "cpu-local", k, args.batch or 1, DEMO_CONTEXT, fmt)
        hardware, target, drafter = base.hardware, base.target, base.drafter
        context = base.context if args.context is None else args.context
        name = "demo"
    else:
        if not args.hardware or not args.target_config:
            raise ValueError("pass --deployment demo, or both --hardware NAME and --target-config NAME|PATH "
                             "(e.g. --hardware h200 --target-config qwen3-8b)")
        hardware, target, drafter = get_profile(args.hardware), load_model_profile(args.target_config), None
        context = 1024 if args.context is None else args.context
        name = f"{target.name} on {hardware.name}"
    if args.target_config and args.deployment:
        target = load_model_profile(args.target_config)
    if args.drafter_config:
        kind = args.drafter_kind or "model"
        if kind in ("ngram", "none"):
            raise ValueError(f"--drafter-kind {kind} takes no --drafter-config; use model or block, or drop the "
                             f"config")
        drafter = Drafter(kind, load_model_profile(args.drafter_config, args.drafter_layers))
    elif args.drafter_layers:
        raise ValueError("--drafter-layers needs --drafter-config (the config whose first layers the drafter keeps)")
    elif args.drafter_kind:
        drafter = Drafter.ngram() if args.drafter_kind == "ngram" else Drafter(args.drafter_kind)
    if bench_entry is not None and bench_entry.name == "sd-ngram":
        drafter = Drafter.ngram()  # the method measured, whatever the deployment's default drafter
    if drafter is None:
        drafter = Drafter.ngram()
    return CostDeployment(name, hardware, target, drafter, k, args.batch or 1, context, fmt)


def run_costmodel(args: argparse.Namespace) -> dict:
    """Everything `specpilot costmodel` does but printing: returns the JSON report."""

    entry, ar_ms, num_prompts, dtype = None, None, None, None
    if args.bench:
        bench, entry, ar_ms = _read_bench(args.bench, args.method)
        num_prompts, dtype = bench.get("num_prompts"), bench.get("dtype")
        if args.batch and args.batch != 1:
            raise ValueError(f"--batch {args.batch} with --bench: the bench runs one request at a time; drop --batch")
    dep = build_deployment(args, entry, dtype)
    sweep, why_not = step_sweep(args, dep)
    report = build_report(dep, args.tau, entry, ar_ms, num_prompts, steps=sweep)
    if why_not:
        report["notes"].append(f"no prediction_error: {why_not}")
    if args.plot:
        report["plot"] = str(plot_gaps(report, args.plot))
    return report


def step_sweep(args: argparse.Namespace, dep: CostDeployment) -> tuple[StepSweep | None, str | None]:
    """The measured step times `prediction_error` scores, or None and why: the hardware profile's sweep when
    it was measured on this deployment's target and format; else, with --deployment demo on this machine's
    profile, a short measurement of the demo models now, at the deployment's context and the profile's
    threads (the torch import is here, after every check, so the arithmetic stays torch-free)."""
    stored, reason = dep.hardware.measured.get("steps"), None
    if stored:
        try:
            sweep = StepSweep.from_dict(stored)
        except AccuracyError as e:
            raise ValueError(f"hardware profile {dep.hardware.name}: {e}") from e
        reason = sweep_mismatch(sweep, dep.target, dep.fmt)
        if reason is None:
            return replace(sweep, extra={**sweep.extra, "source": f"hardware profile {dep.hardware.name}"}), None
    if args.deployment != "demo" or args.target_config:
        return None, reason or (f"the {dep.hardware.name} profile holds no step sweep of this target; run "
                                f"`specpilot profile hardware --model DIR` on the machine it describes")
    if dep.hardware.name != LOCAL:
        return None, f"{dep.hardware.name} is not this machine: the demo's forwards timed here would not match"
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(dep.fmt)
    if dtype is None:
        return None, f"the Hugging Face forward runs bf16 or fp32, not {dep.fmt}: nothing to time"
    target = _demo_target()
    if target is None:
        return None, "the demo target has no weights to time; run `specpilot train demo`"
    from decoder.lab.hardware import measure_steps  # torch: only when a measurement is due

    print(f"measuring the demo's step times for prediction_error (~{args.steps_seconds:g} s; `specpilot profile "
          f"hardware` stores them)", file=sys.stderr)
    sweep = measure_steps(target, _demo_drafter(), dep.context, dtype, args.steps_seconds,
                          threads=dep.hardware.measured.get("threads"))
    return replace(sweep, extra={**sweep.extra, "source": "measured now"}), None


def cmd_costmodel(args: argparse.Namespace) -> int:
    """Handler of `specpilot costmodel`: table (or --json) on stdout; 2 on a user error."""

    if args.kernels:
        return cmd_kernels(args)
    try:
        report = run_costmodel(args)
    except ValueError as e:
        return _fail(str(e))
    print(json.dumps(report) if args.json else format_table(report))
    return 0


def _kernel_model(name: str) -> Path:
    if name == "smollm2":
        path = smollm2_dir() / GGUF_NAME
        if not path.is_file():
            raise ValueError(f"--kernels smollm2: {path} is not there; fetch it once with `specpilot bench "
                             f"--deployment smollm2` (or pass a GGUF file)")
        return path
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--kernels {name}: no such file; pass a GGUF model file or smollm2")
    return path


def cmd_kernels(args: argparse.Namespace) -> int:
    """`specpilot costmodel --kernels MODEL`: the matmul kernels ranked by their gap to the roofline."""
    try:
        model = _kernel_model(args.kernels)
    except ValueError as e:
        return _fail(str(e))
    print(f"measuring {model.name}'s matmul kernels at widths {','.join(map(str, args.widths))} "
          f"({args.threads} thread(s))...", file=sys.stderr, flush=True)
    try:
        with measurement_lock():  # timed: no other SpecPilot timing on this machine meanwhile
            report, table = kernel_profile_report(model, threads=args.threads, widths=args.widths)
        if args.plot:
            plot_kernel_widths(report, Path(args.plot))
    except KernelBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ENGINE
    except ValueError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"--plot {args.plot}: cannot write it ({e.strerror})")
    print(json.dumps(report) if args.json else table)
    return 0


def _demo_target() -> str | None:
    """The demo target's directory when it is trained (the model `profile hardware` validates on)."""

    try:
        target = demo_dir() / "target"
    except ValueError:
        return None
    return str(target) if (target / "model.safetensors").is_file() else None


def _demo_drafter() -> str | None:
    """The demo draft model's directory when it is trained (timed beside the demo target)."""
    try:
        drafter = demo_dir() / "drafter"
    except ValueError:
        return None
    return str(drafter) if (drafter / "model.safetensors").is_file() else None


def cmd_profile(args: argparse.Namespace) -> int:
    """Handler of `specpilot profile hardware`: measures, stores, prints a summary; 2 on a user error."""
    if args.what != "hardware":
        return _fail(f"profile {args.what}: unknown; available: hardware")
    if not PROFILE_NAME.fullmatch(args.name):  # the name is a file stem in the data dir: no path may escape it
        return _fail(f"--name {args.name!r}: use letters, digits, '.', '_' and '-' only (a file name, no folders), "
                     f"e.g. cpu-local; to write elsewhere pass --out FILE")
    if args.out and Path(args.out).is_dir():
        return _fail(f"--out {args.out}: is a folder; pass a file path, e.g. {Path(args.out) / (args.name + '.json')}")
    try:
        model = None if args.no_model else args.model or _demo_target()
        if model and not (Path(model) / "config.json").is_file():
            raise ValueError(f"--model {model}: no config.json there; pass a local Hugging Face model directory")
        if args.drafter and not model:
            raise ValueError("--drafter needs the target it drafts for: drop --no-model, or pass --model DIR")
        drafter = args.drafter or (_demo_drafter() if model and not args.model else None)
        if drafter and not (Path(drafter) / "config.json").is_file():
            raise ValueError(f"--drafter {drafter}: no config.json there; pass a local Hugging Face model directory")
    except ValueError as e:
        return _fail(str(e))
    from decoder.lab.hardware import measure_cpu_local_repeated  # torch: after the checks that need none

    try:
        if model:
            print(f"measuring this machine and the verify step of {model} (~{args.seconds:g} s)", file=sys.stderr)
        profile = measure_cpu_local_repeated(model, args.seconds, context=args.context, dtype=args.dtype,
                                             name=args.name, steps=bool(model), drafter_dir=drafter)
        # The default name in float32: its own file, never over the bfloat16 profile (the loop reads each).
        path = save_profile(profile, args.out or (local_profile_path(args.dtype) if args.name == LOCAL else None))
    except ValueError as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(profile.to_dict()))
        return 0
    print(f"{profile.name}: copy bandwidth {profile.mem_bandwidth_GBps:.1f} GB/s, matmul bf16 "
          f"{profile.achieved_bf16_tflops * 1e3:.1f} GFLOPS, fp32 {profile.achieved_fp32_tflops * 1e3:.1f} GFLOPS, "
          f"overhead {profile.fixed_overhead_ms:.3f} ms + {profile.per_layer_overhead_ms:.3f} ms/layer "
          f"({profile.measured['threads']} threads; quietest of {len(profile.measured['repeats'])} runs, "
          f"spread {profile.measured['spread']:.0%}, load average {profile.measured['load_avg']})")
    val = profile.measured.get("validation")
    if val:
        print(f"verify sweep on {val['model']} (context {val['context']}): fitted bandwidth "
              f"{profile.achieved_bandwidth_GBps:.1f} GB/s; median abs rel error {val['median_abs_rel_error']:.1%}")
    steps = profile.measured.get("steps")
    if steps:
        kinds = "AR, verify, batched" + (", draft" if steps["drafter"] else "")
        kv = f"; KV rate {profile.kv_bandwidth_GBps:.2f} GB/s fitted with batched B = 2, 8" \
            if profile.kv_bandwidth_GBps else ""
        print(f"step sweep: {len(steps['points'])} forwards ({kinds}) timed in {steps['rounds']} interleaved rounds "
              f"for `specpilot costmodel`'s prediction_error{kv}")
    print(f"saved {path}")
    return 0
