"""Evaluating an agent's attempt and integrating a round's kept branches into a new base: functions of the
workspace that the loop (`workbench/loop.py`) and the TUI's launch call; the store records every step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import git

from decoder.config import ConfigError, dump_table, read_table
from workbench.agents.base import AgentResult
from workbench.cascade import Attempt, evaluate
from workbench.costing import Say
from workbench.export import record_mechanism
from workbench.progress import tracking
from workbench.workspace import Workspace


def evaluate_attempt(ws: Workspace, name: str, family: str, agent: str, res: AgentResult, base: str, base_ar: float,
                     ceiling: float, min_gain: float, say: Say, run: Callable[..., Attempt] = evaluate) -> dict:
    """The cascade on an agent's branch (or a discard when it committed nothing); the attempt's record.
    `run` is the cascade here, or an executor's that runs it elsewhere (`workbench.executor`)."""
    b = ws.branch(name)
    if not res.committed or ws.head(name) == base:
        ws.memory.add_evaluation(b.id, "agent", "discard", res.message or "no change committed")
        ws.memory.update_branch(b.id, status="discarded")
        return {"branch": name, "agent": agent, "direction": family, "status": "discard",
                "reason": f"no change: {res.message}", "speedup": None, "details": res.details}
    att: Attempt = run(ws, name, base, base_ar, ceiling, min_gain=min_gain, progress=say)
    out = {"branch": name, "agent": agent, "direction": family, "status": att.status, "reason": att.reason,
           "speedup": att.speedup, "speedup_over_ar": att.speedup_over_ar, "mechanism": res.mechanism,
           "summary": res.summary, "config": res.details.get("config"), "ci95": att.ci95, "points": att.points,
           **({"kernel": res.details["kernel_evidence"]} if res.details.get("kernel_evidence") else {})}
    say(f"  {name}: {att.status}: {att.reason}", "loop.attempt", out)
    return out


def integrate_kept(ws: Workspace, index: int, round_id: int, base: str, kept: list[dict], base_ar: float,
                   ceiling: float, min_gain: float, say: Say, run: Callable[..., Attempt] = evaluate) -> dict:
    """One new base from a round's kept attempts: the best single one, or all of them merged (a config
    conflict merged key by key) when the combination, evaluated by the cascade, beats it. Returns the choice:
    commit, speedup over the old base, merged branches (and skipped ones)."""
    if not kept:
        return {"commit": base, "speedup": 1.0, "merged": [], "note": "nothing kept"}
    kept = sorted(kept, key=lambda a: -(a["speedup"] or 0))
    best = kept[0]
    if len(kept) == 1:
        chosen = {"commit": ws.head(best["branch"]), "speedup": best["speedup"], "merged": [best["branch"]],
                  "points": best.get("points")}
    else:
        name = f"r{index}-combined"
        if ws.find_branch(name) is not None:
            ws.reset_branch(name, base)
        else:
            ws.create_branch(name, base=base, agent="integrator", direction="+".join(a["direction"] for a in kept),
                             round_id=round_id)
        wt = ws.worktree_git(name)
        merged, skipped = [], []
        for a in kept:
            ok, why = merge_branch(wt, a["branch"], ws.config.config_file)
            (merged if ok else skipped).append(a["branch"] if ok else f"{a['branch']} ({why})")
        if len(merged) < 2:
            chosen = {"commit": ws.head(best["branch"]), "speedup": best["speedup"], "points": best.get("points"),
                      "merged": [best["branch"]], "skipped": skipped}
        else:
            with tracking(ws.state, name):
                att = run(ws, name, base, base_ar, ceiling, min_gain=min_gain, progress=say)
            say(f"  {name} ({' + '.join(merged)}): {att.status}: {att.reason}")
            if att.status == "keep" and (att.speedup or 0) >= best["speedup"]:
                chosen = {"commit": ws.head(name), "speedup": att.speedup, "merged": merged,
                          "skipped": skipped, "points": att.points}
            else:
                chosen = {"commit": ws.head(best["branch"]), "speedup": best["speedup"], "points": best.get("points"),
                          "merged": [best["branch"]], "skipped": skipped,
                          "note": f"combination {att.status} ({att.reason}); best single kept"}
    return chosen


def record_kept(ws: Workspace, a: dict, base: str, family: str, index: int | None = None):
    """A kept attempt `a` as a candidate mechanism with its evidence (the loop's integration and the TUI's
    launch record the same way); sets a["mechanism_id"]."""
    ev = {"deployment": ws.config.name, "speedup": a["speedup"], "speedup_over_ar": a.get("speedup_over_ar"),
          **({"round": index} if index is not None else {}), "branch": a["branch"], "forcing": "clean",
          "config": a.get("config") or {}, **({"kernel": a["kernel"]} if a.get("kernel") else {})}
    m = record_mechanism(ws, a["branch"], a.get("mechanism") or a["branch"], family, a.get("summary") or a["reason"],
                         evidence=ev, base=base)
    a["mechanism_id"] = m.id
    return m


def merge_branch(wt: git.Git, branch: str, config_file: str) -> tuple[bool, str]:
    """Merge `branch` into the worktree's HEAD; a conflict confined to the TOML config is merged key by key."""
    try:
        wt.merge("--no-ff", "--no-edit", "-m", f"integrate {branch}", branch)
        return True, ""
    except git.GitCommandError:
        pass
    conflicted = wt.diff("--name-only", "--diff-filter=U").splitlines()
    if conflicted != [config_file]:
        wt.merge("--abort")
        return False, f"conflicts in {', '.join(conflicted) or 'the tree'}"
    base_sha = wt.merge_base("HEAD", branch)
    try:
        b, o, t = (read_table(wt.show(f"{ref}:{config_file}")) for ref in (base_sha, "HEAD", branch))
    except ConfigError as e:
        wt.merge("--abort")
        return False, f"{config_file} on one side: {e}"
    merged = {}
    for k in sorted(set(b) | set(o) | set(t)):
        bv, ov, tv = b.get(k), o.get(k), t.get(k)
        if ov == tv or tv == bv:
            merged[k] = ov
        elif ov == bv:
            merged[k] = tv
        else:
            wt.merge("--abort")
            return False, f"both set {k} ({ov!r} vs {tv!r})"
    # Written as merged, not validated against the installed DecodeConfig: a key one side added belongs
    # to that side's code; the combination is evaluated (smoke, forcing, bench) before anything is kept.
    try:
        text = dump_table({k: v for k, v in merged.items() if v is not None})
    except ConfigError as e:
        wt.merge("--abort")
        return False, f"merged config cannot be written: {e}"
    (Path(wt.working_dir) / config_file).write_text(text)
    wt.add(config_file)
    wt.commit("--no-edit", "-m", f"integrate {branch} ({config_file} merged key by key)")
    return True, "config merged key by key"
