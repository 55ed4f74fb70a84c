"""Token forcing: every output token of a candidate checked against stock's greedy output.

Stock's tokens for each forcing prompt (visible and hidden splits) are computed once by running the
stock commit through the same harness, and cached in `.specpilot/stock/`, with stock's top-2 logit
margin at every position from one teacher-forced forward of the target, and the deployment's noise
floor (the largest logit difference between one-token and multi-token forwards, `decoder.lab.bench`).

The candidate then generates for each prompt. At the first position where its token differs from
stock's, the mismatch is recorded, and the candidate is asked again from the prompt plus stock's
tokens up to and including that position: stock's token is put in place and generation continues,
so every position is checked, not only the first divergence. A mismatch whose stock margin is below
twice the noise floor is a numerical near tie; any other is a real change. Lossless means no
unexplained mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from decoder.contract import near_tie, near_tie_threshold
from decoder.engines.llamacpp import LlamaServer, ServerSettings, SpecSettings
from decoder.engines.llamacpp_config import LlamaCppConfig
from workbench.engine_source import engine_server
from workbench.harness import Limits, SystemCrash, SystemProcess
from workbench.progress import step
from workbench.workspace import STOCK_TAG, Workspace, WorkspaceError

STOCK_WORKTREE = "_stock"
NOISE_CHUNKS = (2, 4, 8)
NOISE_PROMPTS = 4
NOISE_STRIDE = 8  # llama.cpp: every 8th position of a noise prompt is also evaluated from scratch


@dataclass
class ForcingPrompt:
    id: str
    split: str  # visible or hidden
    prompt_ids: list[int]
    stock: list[int]
    margins: list[float]  # stock's top-2 logit margin at each generated position


def limits_of(ws: Workspace) -> Limits:
    lim = ws.config.limits
    return Limits(start_s=float(lim.get("start_s", 120)), request_s=float(lim.get("request_s", 120)),
                  memory_mb=int(lim.get("memory_mb", 4096)), threads=int(lim.get("threads", 0)) or None)


def forcing_prompt_texts(ws: Workspace) -> list[tuple[str, str, str]]:
    """(id, split, text) of every forcing prompt: the visible set as committed in stock, then the hidden set."""
    out = []
    visible = ws.repo.git.show(f"{STOCK_TAG}:prompts/visible.jsonl")
    hidden_path = ws.hidden_prompts_path()
    if not hidden_path.exists():
        raise WorkspaceError(f"{hidden_path} is missing: the hidden forcing split is gone; re-create the workspace")
    for split, text in (("visible", visible), ("hidden", hidden_path.read_text())):
        for ln in text.splitlines():
            if ln.strip():
                row = json.loads(ln)
                out.append((str(row["id"]), split, row["text"]))
    return out


def run_system(ws: Workspace, worktree: Path, log_name: str) -> SystemProcess:
    """The worktree's system, not started. A workspace carrying the engine's source runs the engine built
    from the worktree's commit (built first when new: untimed, SystemCrash("build") when it fails)."""
    server = engine_server(ws, ws.commit_of(worktree)) if ws.config.engine_source else None
    return SystemProcess(worktree, ws.entry_argv(server), limits_of(ws),
                         read_only=ws.config.model_dirs() + ([server.parent] if server else []),
                         log_path=ws.state / "logs" / f"{log_name}-{time.strftime('%Y%m%d-%H%M%S')}.log")


def stock_reference(ws: Workspace, progress: bool = True) -> dict:
    """Stock's cached reference for this workspace (computed on first use)."""
    from decoder.models import load_tokenizer

    tok = load_tokenizer(ws.config.tokenizer)
    prompts = [(pid, split, tok(text, add_special_tokens=False)["input_ids"])
               for pid, split, text in forcing_prompt_texts(ws)]
    n = ws.config.forcing_max_new_tokens
    key = hashlib.sha256(json.dumps([ws.stock_commit, n, str(ws.config.target), ws.config.dtype,
                                     [p[2] for p in prompts]]).encode()).hexdigest()[:16]
    path = ws.state / "stock" / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())

    rows = []
    with run_system(ws, ws.detached_worktree(STOCK_WORKTREE, ws.stock_commit), "stock") as sp:
        for pid, split, ids in tqdm(prompts, desc="stock reference", disable=not progress, unit="prompt"):
            rows.append({"id": pid, "split": split, "prompt_ids": ids, "stock": sp.generate(ids, n).tokens})
    floor = _margins_and_noise(ws, rows)
    ref = {"stock_commit": ws.stock_commit, "max_new_tokens": n, "noise_floor": floor, "prompts": rows}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ref))
    os.replace(tmp, path)  # a crash leaves no half-written reference behind
    return ref


def fixed_server_flags(ws: Workspace) -> list[str]:
    """The flags a llama.cpp workspace's every server gets (`--server-flag=F` in its entry, set at init)."""
    return [a.split("=", 1)[1] for a in ws.config.entry if a.startswith("--server-flag=")]


def _llama_margins_and_noise(ws: Workspace, rows: list[dict]) -> float:
    """A llama.cpp workspace: stock's top-2 margins at every position from llama-server itself (top-2
    log-probabilities, one cached one-token forward per position; their difference is the logit margin), and
    the noise floor: the largest margin difference between those one-token forwards and the same positions
    evaluated from scratch in prompt batches, on NOISE_PROMPTS prompts (every NOISE_STRIDE-th position).
    Stock's binary and the deployment's model, run here (they are not candidate files)."""
    cfg = LlamaCppConfig.from_table(ws.config_at(ws.stock_commit), known_only=True)
    server = Path(ws.config.engine_bin or "") / "llama-server"
    floor = 0.0
    with tempfile.TemporaryDirectory(prefix="specpilot-margins-") as tmp, LlamaServer(
            ws.config.target, SpecSettings(extra=(*cfg.server_flags(), *fixed_server_flags(ws))),
            ServerSettings(threads=1, ctx_size=cfg.ctx_size),  # untimed: one thread never waits on a busy core
            name="llama-server (stock margins)", log_dir=Path(tmp), server=server) as srv:
        for i, r in enumerate(tqdm(rows, desc="stock margins", unit="prompt", disable=not os.isatty(2))):
            p, s = r["prompt_ids"], r["stock"]
            scores = srv.score(p, s[:-1]) if s else []
            r["margins"] = [sc.margin if sc.margin is not None else 1e9 for sc in scores]
            if i < NOISE_PROMPTS:
                for j in range(0, len(s), NOISE_STRIDE):
                    fresh = srv.score_fresh(p + s[:j])
                    if fresh.margin is not None and scores[j].margin is not None:
                        floor = max(floor, abs(fresh.margin - scores[j].margin))
    return floor


def _margins_and_noise(ws: Workspace, rows: list[dict]) -> float:
    """Stock's top-2 margins from one teacher-forced forward per prompt, and the noise floor."""
    if ws.config.engine == "llama.cpp":
        return _llama_margins_and_noise(ws, rows)
    import torch

    from decoder.lab.bench import noise_floor
    from decoder.models import load_causal_lm

    target = load_causal_lm(ws.config.target, "target", ws.config.dtype, ws.config.device)
    device = next(target.parameters()).device
    with torch.inference_mode():
        for r in rows:
            p, s = r["prompt_ids"], r["stock"]
            if not s:
                r["margins"] = []
                continue
            seq = torch.tensor([p + s[:-1]], device=device)
            logits = target(input_ids=seq).logits[0, len(p) - 1:].float()  # predicts s[0..n-1]
            top = torch.topk(logits, 2, dim=-1).values
            r["margins"] = (top[:, 0] - top[:, 1]).tolist()
        floor = noise_floor(target, [(r["prompt_ids"], r["stock"]) for r in rows[:NOISE_PROMPTS]], NOISE_CHUNKS)
    return floor


def timed_output_problem(ref: dict, prompt_id: str, tokens: list[int]) -> str | None:
    """Why an output produced while timed is not stock's (None: it is, up to a first divergence at a
    numerical near tie). Only the first divergence can be judged: after it the contexts differ."""
    row = next((r for r in ref["prompts"] if r["id"] == prompt_id), None)
    if row is None:
        return f"prompt {prompt_id}: not a forcing prompt"
    stock, margins = row["stock"], row.get("margins") or []
    threshold = near_tie_threshold(ref["noise_floor"])
    at = next((j for j, (a, b) in enumerate(zip(tokens, stock, strict=False)) if a != b), None)
    if at is None:
        if len(tokens) == len(stock):
            return None
        return f"prompt {prompt_id}: {len(tokens)} tokens where stock gives {len(stock)}"
    margin = margins[at] if at < len(margins) else None
    if near_tie(margin, ref["noise_floor"]):
        return None
    return (f"prompt {prompt_id}: token {at} is {tokens[at]} where stock gives {stock[at]} "
            f"(margin {margin if margin is None else round(margin, 4)} >= near-tie {threshold:.4g})")


def _force_prompt(sp: SystemProcess, fp: dict, cap: int, tok) -> tuple[list[dict], int, float, int, int]:
    """Check one prompt; returns mismatches, positions checked, first-pass seconds and tokens, restarts."""
    stock, prompt = fp["stock"], fp["prompt_ids"]
    n = len(stock)
    mismatches: list[dict] = []
    pos, restarts, first_s, first_tokens = 0, 0, 0.0, 0
    while pos < n:
        res = sp.generate(prompt + stock[:pos], n - pos)
        if restarts == 0:
            first_s, first_tokens = res.seconds, len(res.tokens)
        out = res.tokens[: n - pos]
        bad = next((j for j, t in enumerate(out) if t != stock[pos + j]), None)
        if bad is None and len(out) == n - pos:
            pos = n
            break
        j = bad if bad is not None else len(out)  # a short answer: the next position is missing
        at = pos + j
        cand = out[j] if bad is not None else None
        margin = fp["margins"][at] if at < len(fp["margins"]) else None
        mismatches.append({"prompt_id": fp["id"], "split": fp["split"], "position": at,
                           "stock_token": stock[at], "candidate_token": cand,
                           "stock_text": tok.decode([stock[at]]),
                           "candidate_text": tok.decode([cand]) if cand is not None else "<end of output>",
                           "margin": margin})
        pos = at + 1
        restarts += 1
        if len(mismatches) >= cap:
            break
    return mismatches, pos, first_s, first_tokens, restarts


def _force_batched(sp: SystemProcess, prompts: list[dict], bs: int, cap: int, tok) -> tuple[list[dict], int]:
    """Forcing under load: the prompts go `bs` at a time to the system's batched engine; a request that
    diverges is asked again, from the prompt plus stock's tokens through the divergence, in a later batch
    that is filled to `bs` requests with other prompts (their outputs unused) so every step runs at this
    load. Returns the mismatches (each with "batch") and the positions checked."""
    pos = {fp["id"]: 0 for fp in prompts}
    count = dict.fromkeys(pos, 0)
    mismatches: list[dict] = []
    pending = list(prompts)
    while pending:
        for i in range(0, len(pending), bs):
            chunk = pending[i:i + bs]
            fill = chunk + [prompts[j % len(prompts)] for j in range(bs - len(chunk))]
            ids = [fp["prompt_ids"] + fp["stock"][:pos[fp["id"]]] if k < len(chunk) else fp["prompt_ids"]
                   for k, fp in enumerate(fill)]
            want = max(len(fp["stock"]) - pos[fp["id"]] for fp in chunk)
            outs = sp.generate_batch(ids, max(1, want)).outputs
            for fp, out in zip(chunk, outs, strict=False):
                stock, at0 = fp["stock"], pos[fp["id"]]
                out = out[: len(stock) - at0]
                bad = next((j for j, t in enumerate(out) if t != stock[at0 + j]), None)
                if bad is None and len(out) == len(stock) - at0:
                    pos[fp["id"]] = len(stock)
                    continue
                j = bad if bad is not None else len(out)
                at, cand = at0 + j, (out[j] if bad is not None else None)
                mismatches.append({"prompt_id": fp["id"], "split": fp["split"], "position": at, "batch": bs,
                                   "stock_token": stock[at], "candidate_token": cand,
                                   "stock_text": tok.decode([stock[at]]),
                                   "candidate_text": tok.decode([cand]) if cand is not None else "<end of output>",
                                   "margin": fp["margins"][at] if at < len(fp["margins"]) else None})
                pos[fp["id"]] = at + 1
                count[fp["id"]] += 1
        pending = [fp for fp in pending if pos[fp["id"]] < len(fp["stock"]) and count[fp["id"]] < cap]
    return mismatches, sum(pos.values())


def force(ws: Workspace, branch: str, *, progress: bool = True, record: bool = True) -> dict:
    """Token-force a branch against stock (see `_force`); a harness error leaves the branch in status error."""
    b = ws.branch(branch)
    try:
        return _force(ws, branch, progress=progress, record=record)
    except BaseException:
        if record and ws.branch(branch).status == "evaluating":
            ws.end_evaluation(b, "error")
        raise


def _force(ws: Workspace, branch: str, *, progress: bool, record: bool) -> dict:
    """Token-force a branch against stock; the report is recorded in the workspace memory and returned.

    `status` is keep (lossless), discard (unexplained mismatches), crash (the system failed: time,
    memory, exit or protocol) or rejected (a protected path touched, or uncommitted changes).
    """
    from decoder.models import load_tokenizer

    b = ws.branch(branch)
    head = ws.head(branch)
    report: dict = {"branch": branch, "commit": head, "stock_commit": ws.stock_commit}

    def finish(status: str, reason: str, forcing: dict | None, metrics: dict | None = None) -> dict:
        report.update({"status": status, "reason": reason})
        if forcing is None:
            report.update({"match_rate": 0.0, "positions_checked": 0, "mismatches": []})
        if record:
            ws.memory.add_evaluation(b.id, "forcing", status, reason, metrics=metrics or {},
                                     forcing=report if forcing is not None else None)
            ws.end_evaluation(b, {"keep": "forced", "discard": "mismatch", "crash": "crashed",
                                  "rejected": "rejected"}[status])
        return report

    if record:
        ws.begin_evaluation(b)
    why = ws.guard(branch)
    if why:
        return finish("rejected", why, None)

    ref = stock_reference(ws, progress)
    tok = load_tokenizer(ws.config.tokenizer)
    floor = float(ref["noise_floor"])
    threshold = near_tie_threshold(floor)
    cap = ws.config.max_mismatches_per_prompt
    mismatches: list[dict] = []
    per_split: dict[str, list[int]] = {}
    checked = restarts = first_tokens = 0
    first_s = 0.0
    truncated = []
    batched: dict[str, dict] = {}
    t0 = time.perf_counter()
    sp = run_system(ws, ws.worktree_path(branch), branch)
    try:
        sp.start()
        total = sum(len(fp["stock"]) for fp in ref["prompts"])
        step("forcing", 0, total)
        for fp in tqdm(ref["prompts"], desc=f"forcing {branch}", disable=not progress, unit="prompt"):
            mm, pos, s, nt, r = _force_prompt(sp, fp, cap, tok)
            step("forcing", checked + pos, total, f"{len(mismatches) + len(mm)} mismatches")
            mismatches += mm
            checked += pos
            first_s += s
            first_tokens += nt
            restarts += r
            if pos < len(fp["stock"]):
                truncated.append(fp["id"])
            split = per_split.setdefault(fp["split"], [0, 0])
            split[0] += pos
            split[1] += len(mm)
        for bs in (b for b in ws.config.batch_sizes if b > 1):  # the load's batched points: same check
            step(f"forcing B={bs}", detail=f"{len(ref['prompts'])} prompts, {bs} at a time")
            mm, pos = _force_batched(sp, ref["prompts"], bs, cap, tok)
            batched[str(bs)] = {"positions_checked": pos, "mismatches": len(mm)}
            mismatches += mm
    except SystemCrash as e:
        report["sandbox"] = {"enabled": sp.sandboxed, "note": sp.sandbox_note}
        return finish("crash", f"{e.kind}: {e.reason}", None, {"kind": e.kind})
    finally:
        sp.close()

    for m in mismatches:
        m["near_tie"] = near_tie(m["margin"], floor)
    unexplained = [m for m in mismatches if not m["near_tie"]]
    for bs, d in batched.items():
        d["unexplained"] = sum(1 for m in unexplained if m.get("batch") == int(bs))
    single = sum(1 for m in mismatches if "batch" not in m)
    report.update({
        "match_rate": (checked - single) / checked if checked else 0.0, "batched": batched,
        "positions_checked": checked, "mismatches": mismatches,
        "unexplained": len(unexplained), "near_ties": len(mismatches) - len(unexplained),
        "noise_floor": floor, "near_tie_threshold": threshold,
        "splits": {k: {"positions_checked": v[0], "mismatches": v[1],
                       "match_rate": (v[0] - v[1]) / v[0] if v[0] else 0.0} for k, v in per_split.items()},
        "prompts": len(ref["prompts"]), "restarts": restarts, "truncated_prompts": truncated,
        "sandbox": {"enabled": sp.sandboxed, "note": sp.sandbox_note},
        "timing": {"first_pass_tokens": first_tokens, "first_pass_seconds": first_s,
                   "tokens_per_s": first_tokens / first_s if first_s else 0.0,
                   "measured_by": "harness, outside the candidate process"},
        "seconds": time.perf_counter() - t0,
    })
    batched_checked = sum(d["positions_checked"] for d in batched.values())
    under_load = (f" and {batched_checked} under load (B = {', '.join(batched)})" if batched else "")
    if unexplained:
        m0 = unexplained[0]
        where = f"{m0['prompt_id']}:{m0['position']}" + (f" at B = {m0['batch']}" if "batch" in m0 else "")
        margin = "unknown" if m0["margin"] is None else format(m0["margin"], ".3g")
        reason = (f"{len(unexplained)} unexplained mismatch(es) in {checked} positions{under_load}; first at "
                  f"{where} (stock {m0['stock_text']!r}, candidate "
                  f"{m0['candidate_text']!r}, margin {margin} >= {threshold:.3g})")
        status = "discard"
    else:
        status = "keep"
        reason = (f"lossless: {checked} positions{under_load}, {len(mismatches)} near tie(s) below margin "
                  f"{threshold:.3g}" if mismatches else f"token-identical to stock on {checked} positions{under_load}")
    if not sp.sandboxed:
        reason += " [NO SANDBOX]"
    return finish(status, reason, report, {"tokens_per_s": report["timing"]["tokens_per_s"]})


def format_report(r: dict, limit: int = 20) -> str:
    """The human-readable report `specpilot force` prints."""
    lines = [f"branch {r['branch']} @ {r['commit'][:10]} vs stock @ {r['stock_commit'][:10]}: "
             f"{r['status'].upper()} - {r['reason']}"]
    sb = r.get("sandbox")
    if sb and not sb["enabled"]:
        lines.append("!! " + sb["note"])
    if r.get("positions_checked"):
        lines.append(f"match rate {r['match_rate']:.4f} over {r['positions_checked']} positions "
                     f"({r['prompts']} prompts, {r['restarts']} restarts); noise floor {r['noise_floor']:.4g}, "
                     f"near-tie margin < {r['near_tie_threshold']:.4g}")
        for k, v in r["splits"].items():
            lines.append(f"  {k:8s} match rate {v['match_rate']:.4f}  positions {v['positions_checked']}  "
                         f"mismatches {v['mismatches']}")
        lines.append(f"  speed (harness-timed, first pass): {r['timing']['tokens_per_s']:.1f} tok/s")
    for m in r["mismatches"][:limit]:
        kind = "near tie" if m.get("near_tie") else "REAL"
        margin = f"{m['margin']:.4g}" if m["margin"] is not None else "-"
        lines.append(f"  {m['prompt_id']}:{m['position']:<4d} stock {m['stock_token']:>5} {m['stock_text']!r:12s} "
                     f"candidate {m['candidate_token'] if m['candidate_token'] is not None else '-':>5} "
                     f"{m['candidate_text']!r:12s} margin {margin:>8s}  {kind}")
    if len(r["mismatches"]) > limit:
        lines.append(f"  ... {len(r['mismatches']) - limit} more (use --json)")
    return "\n".join(lines)
