"""The built-in tuner's kernel search (#24): known kernel patches for a llama.cpp workspace that carries the
engine's source.

The library (`kernels/ggml/kernels.toml`) lists patches to ggml's CPU kernels with the gap families they
address, the weight types they change and the CPU flags they need. For a direction whose family a patch
addresses, on a machine with its flags, and a base that does not carry it yet, the tuner applies it to its
worktree, commits, and runs the kernel test (`workbench/kernel_check.py`: rebuilt in the sandbox, outputs on
the deployment's real weights against stock's) with its micro-benchmark. A patch that fails the test is
reverted; one whose micro-benchmark shows no gain at width 1 or at the verify width (a model without the
weight type it changes) is reverted too; the first that passes both is the agent's change, and the cascade
then measures it end to end like any other. The micro-benchmark is the candidate build's own account: it
only decides what the agent submits, never a verdict.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workbench.agents.base import AgentContext, AgentResult
from workbench.engine_source import SOURCE_REL, _git
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


def _added_lines(patch: str) -> dict[str, list[str]]:
    """The lines a patch adds, per file (paths inside the engine tree)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in patch.splitlines():
        if line.startswith("+++ "):
            current = line[4:].removeprefix("b/").strip()
            out[current] = []
        elif current and line.startswith("+") and line[1:].strip():
            out[current].append(line[1:])
    return out


def carried(ws, commit: str, k: KernelPatch) -> bool:
    """Whether `commit`'s engine tree already has every line `k` adds (hardened git on the main repository)."""
    g = _git(ws)
    for rel, lines in _added_lines(k.text()).items():
        try:
            blob = g.show(f"{commit}:{SOURCE_REL}/{rel}")
        except Exception:  # noqa: BLE001 - a file the engine tree lacks: the patch is not carried
            return False
        if not all(line in blob for line in lines):
            return False
    return True


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


def kernel_search(ws, ctx: AgentContext, kernels: list[KernelPatch],
                  then: Callable[[], AgentResult | None] | None = None) -> AgentResult:
    """Try `kernels` in order on the agent's branch; the first that passes the kernel test and shows a gain
    stays committed. `then`: a search run next on the branch (its system now the rebuilt engine), e.g. the
    drafting tuner when the base does not speculate, since a kernel for wide forwards has nothing to speed up
    there; what it commits joins the kernel in one change."""
    g = ws.worktree_git(ctx.branch)
    tried = []
    for k in kernels:
        if ctx.stop.is_set():
            break
        ctx.log("tuner.kernel", f"applying {k.name}", {"kernel": k.name, "patch": k.patch.name})
        try:
            g.apply(f"--directory={SOURCE_REL}", str(k.patch))
        except Exception as e:  # noqa: BLE001 - a patch that does not apply to this base: the next one
            tried.append(f"{k.name}: does not apply to the base ({str(e).splitlines()[-1][:120]})")
            continue
        g.add("-A")
        g.commit("-q", "-m", f"kernel: {k.name}: {k.summary}")
        try:
            kc = kernel_check(ws, ws.head(ctx.branch))
        except SystemCrash as e:
            kc = {"ok": False, "reason": f"{e.kind}: {e.reason}"}
        gain = _predicted_gain(kc.get("micro", {}))
        ctx.log("tuner.kernel", f"{k.name}: {kc['reason']}", {"kernel": k.name, "check": kc, "gain": gain})
        best = max((gain.get(w, 0.0) for w in ("1", "4")), default=0.0)
        if kc["ok"] and best >= MIN_PREDICTED_GAIN:
            where = ", ".join(f"w{w} {v:.2f}x" for w, v in gain.items())
            # What the memory keeps so the kernel transfers to deployments that share its weight types and shapes
            # on the same kind of CPU: the shapes are the model's weight groups the patch's types cover.
            evidence = {"name": k.name, "weight_types": list(k.weight_types), "cpu_flags": list(k.cpu_flags),
                        "shapes": kernel_shapes(ws, k), "kernel_test": kc["reason"],
                        "max_rel_error": kc.get("max_rel_error"), "micro": kc.get("micro"),
                        "cpu": cpu_model()}
            message = (f"kernel {k.name}: {kc['reason']}; the candidate's micro-benchmark of the forward's "
                       f"matmuls: {where} of stock's")
            details = {"kernel": k.name, "kernel_check": kc, "kernel_evidence": evidence}
            follow = then() if then is not None and not ctx.stop.is_set() else None
            if follow is not None and follow.committed:
                return AgentResult(True, f"{message}; then on the rebuilt engine: {follow.message}",
                                   mechanism=f"{k.name}+{follow.mechanism}", summary=f"{k.summary}; {follow.summary}",
                                   details={**details, "config": follow.details.get("config"),
                                            "then": follow.message})
            if follow is not None:
                message += f"; then on the rebuilt engine: {follow.message}"
            return AgentResult(True, message, mechanism=k.name, summary=k.summary, details=details)
        g.reset("-q", "--hard", "HEAD~1")
        tried.append(f"{k.name}: {kc['reason'] if not kc['ok'] else 'no gain in its micro-benchmark'}")
    return AgentResult(False, "no kernel patch kept: " + "; ".join(tried) if tried else "stopped")
