"""The built-in tuner's kernel search (#24): known kernel patches for a llama.cpp workspace that carries the
engine's source.

The library (`kernels/ggml/kernels.toml`) lists patches to ggml's CPU kernels with the gap families they
address, the weight types they change and the CPU flags they need. For a direction whose family a patch
addresses, on a machine with its flags, and a base that does not carry it yet, the tuner applies it to its
worktree, commits, and runs the kernel test (`workbench/kernel_check.py`: rebuilt in the sandbox, outputs on
the deployment's real weights against stock's) with its micro-benchmark. A patch that fails the test is
reverted; one whose micro-benchmark shows no gain at width 1 or at the verify width over the build before
it (a model without the weight type it changes) is reverted too; those that pass both stack, in the library's
order, into the agent's change, and the cascade then measures it end to end like any other. The
micro-benchmark is the candidate build's own account: it only decides what the agent submits, never a verdict.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workbench.agents.base import AgentContext, AgentResult
from workbench.engine_source import apply_patch, carries
from workbench.harness import SystemCrash
from workbench.kernel_check import kernel_check

LIBRARY = Path(__file__).resolve().parents[2] / "kernels" / "ggml" / "kernels.toml"
MIN_PREDICTED_GAIN = 1.03  # the micro-benchmark's forward at width 1 or 4 against stock's


@dataclass(frozen=True)
class KernelPatch:
    name: str
    families: tuple[str, ...]
    patch: Path
    weight_types: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    summary: str

    def text(self) -> str:
        return self.patch.read_text()


def library(path: Path = LIBRARY) -> list[KernelPatch]:
    """The known kernel patches."""
    data = tomllib.loads(path.read_text())
    return [KernelPatch(str(k["name"]), tuple(k["families"]), path.parent / str(k["patch"]),
                        tuple(k.get("weight_types", ())), tuple(k.get("cpu_flags", ())), str(k.get("summary", "")))
            for k in data.get("kernel", [])]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def kernel_shapes(ws, k: KernelPatch) -> list[list]:
    """[type, k, n, count] of the deployment's weight groups whose type the patch changes (from stock's kernel
    profile when the loop measured one)."""
    try:
        prof = json.loads((ws.state / "kernels.json").read_text())["profile"]
    except (OSError, ValueError, KeyError):
        return []
    seen = {(r["type"], r["k"], r["n"], r["count"]) for r in prof.get("kernels", []) if r["type"] in k.weight_types}
    return [list(s) for s in sorted(seen)]


def carried(ws, commit: str, k: KernelPatch) -> bool:
    """Whether `commit`'s engine tree already has every line `k` adds."""
    return carries(ws, commit, k.text())


def applicable(ws, commit: str, family: str) -> list[KernelPatch]:
    """The library's patches for `family` that this machine can run and `commit` does not carry yet; none when
    the workspace does not carry the engine's source."""
    if not ws.config.engine_source:
        return []
    flags = cpu_flags()
    return [k for k in library() if family in k.families and set(k.cpu_flags) <= flags and not carried(ws, commit, k)]


def _predicted_gain(micro: dict) -> dict[str, float]:
    stock, mine = micro.get("stock_forward_ms", {}), micro.get("candidate_forward_ms", {})
    return {w: stock[w] / mine[w] for w in stock if w in mine and mine[w] > 0}


def _gain_over(micro: dict, before: dict | None) -> dict[str, float]:
    """Per width, the forward of matmuls of `before`'s build (stock's when None) over the candidate's."""
    if before is None:
        return _predicted_gain(micro)
    prev, mine = before.get("candidate_forward_ms", {}), micro.get("candidate_forward_ms", {})
    return {w: prev[w] / mine[w] for w in prev if w in mine and mine[w] > 0}


def _evidence(ws, kept: list[tuple[KernelPatch, dict]]) -> dict:
    """What the memory keeps so the kernels transfer to deployments that share their weight types and shapes on
    the same kind of CPU: the shapes are the model's weight groups the patches' types cover. The kernel test and
    micro-benchmark are the last build's, which carries every kept patch."""
    last = kept[-1][1]
    one = [{"name": k.name, "weight_types": list(k.weight_types), "cpu_flags": list(k.cpu_flags),
            "shapes": kernel_shapes(ws, k), "kernel_test": kc["reason"], "max_rel_error": kc.get("max_rel_error"),
            "micro": kc.get("micro")} for k, kc in kept]
    return {"name": "+".join(k.name for k, _ in kept),
            "weight_types": sorted({t for k, _ in kept for t in k.weight_types}),
            "cpu_flags": sorted({f for k, _ in kept for f in k.cpu_flags}),
            "shapes": [s for e in one for s in e["shapes"]], "kernel_test": last["reason"],
            "max_rel_error": last.get("max_rel_error"), "micro": last.get("micro"), "cpu": cpu_model(),
            **({"kernels": one} if len(one) > 1 else {})}


def kernel_search(ws, ctx: AgentContext, kernels: list[KernelPatch],
                  then: Callable[[], AgentResult | None] | None = None) -> AgentResult:
    """Try `kernels` in order on the agent's branch, each on top of those kept before it: one that passes the
    kernel test and shows a gain over the build before it stays committed (kernels for different weight types,
    e.g. Q4_1 layers and a Q8_0 LM head, stack into one change). `then`: a search run next on the branch (its
    system now the rebuilt engine), e.g. the drafting tuner when the base does not speculate, since a kernel for
    wide forwards has nothing to speed up there; what it commits joins the kernels in one change."""
    g = ws.worktree_git(ctx.branch)
    tried: list[str] = []
    kept: list[tuple[KernelPatch, dict]] = []
    for k in kernels:
        if ctx.stop.is_set():
            break
        ctx.log("tuner.kernel", f"applying {k.name}", {"kernel": k.name, "patch": k.patch.name})
        why = apply_patch(g, k.patch)
        if why is not None:  # a patch that does not apply to this base: the next one
            tried.append(f"{k.name}: does not apply to the base ({why})")
            continue
        g.add("-A")
        g.commit("-q", "-m", f"kernel: {k.name}: {k.summary}")
        try:
            kc = kernel_check(ws, ws.head(ctx.branch))
        except SystemCrash as e:
            kc = {"ok": False, "reason": f"{e.kind}: {e.reason}"}
        gain = _predicted_gain(kc.get("micro", {}))
        step = _gain_over(kc.get("micro", {}), kept[-1][1].get("micro") if kept else None)
        ctx.log("tuner.kernel", f"{k.name}: {kc['reason']}", {"kernel": k.name, "check": kc, "gain": gain,
                                                               "gain_over_previous": step})
        if kc["ok"] and max((step.get(w, 0.0) for w in ("1", "4")), default=0.0) >= MIN_PREDICTED_GAIN:
            kept.append((k, kc))
            continue
        g.reset("-q", "--hard", "HEAD~1")
        tried.append(f"{k.name}: {kc['reason'] if not kc['ok'] else 'no gain in its micro-benchmark'}")
    if not kept:
        return AgentResult(False, "no kernel patch kept: " + "; ".join(tried) if tried else "stopped")
    last = kept[-1][1]
    gain = _predicted_gain(last.get("micro", {}))
    where = ", ".join(f"w{w} {v:.2f}x" for w, v in gain.items())
    name = "+".join(k.name for k, _ in kept)
    summary = "; ".join(k.summary for k, _ in kept)
    message = (f"kernel {name}: {last['reason']}; the candidate's micro-benchmark of the forward's "
               f"matmuls: {where} of stock's")
    if tried:
        message += f" (not kept: {'; '.join(tried)})"
    details = {"kernel": name, "kernel_check": last, "kernel_evidence": _evidence(ws, kept)}
    follow = then() if then is not None and not ctx.stop.is_set() else None
    if follow is not None and follow.committed:
        return AgentResult(True, f"{message}; then on the rebuilt engine: {follow.message}",
                           mechanism=f"{name}+{follow.mechanism}", summary=f"{summary}; {follow.summary}",
                           details={**details, "config": follow.details.get("config"), "then": follow.message})
    if follow is not None:
        message += f"; then on the rebuilt engine: {follow.message}"
    return AgentResult(True, message, mechanism=name, summary=summary, details=details)
