"""`specpilot bench --peers llama.cpp`: llama.cpp's AR and speculative decoding beside our methods.

One `llama-server` per llama.cpp method (speculative flags are fixed when a server starts), all started
before the run and stopped after it, also on errors. The bench interleaves their requests with our
methods prompt by prompt and times each request from outside (wall time around the HTTP request, prompt
prefill included, as our methods include theirs). llama.cpp runs on as many threads as torch uses here.

Methods: `llama.cpp-ar` (speculation off), on a GGUF of the very weights our engine runs (the demo converted
with llama.cpp's converter; smollm2's Q4_1 dequantised), `llama.cpp-draft-simple` (the deployment's draft model as a
GGUF, `--spec-draft-n-max` = the bench's `--draft-len`), and every n-gram type the built server lists
(`ngram-simple`, `ngram-map-k`, ...) with llama.cpp's defaults. Types that need a model the deployment does
not have (EAGLE-3, MTP, DFlash, ...) are skipped with that reason; a server that will not start is skipped
with its error. On smollm2, `llama.cpp-ar-q4_1` is llama.cpp AR on the original Q4_1 GGUF (the file users run):
other weights and arithmetic (Q8 activations), so it is its own reference, and its agreement with llama.cpp
AR is reported for information only.

Lossless check of a llama.cpp method: its greedy output against llama.cpp AR's, prompt by prompt; at the
first divergence llama.cpp AR's own top-2 logit margin there (`score`, from `n_probs`: exact logit
margins, decoder/engines/llamacpp.py) against the deployment's near-tie threshold (decoder/contract.py,
the bench's noise floor). llama.cpp AR itself is compared with hf-greedy the way our methods are, for
information: two engines' bf16 arithmetic differ, so its divergences say how far the engines agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from decoder.contract import first_divergence, near_tie
from decoder.engines import Engine, EngineError, EngineNotBuilt
from decoder.engines.llamacpp import LlamaServer, ServerSettings, SpecSettings, require_built, server_spec_types
from decoder.engines.llamacpp_build import LLAMA_CPP_PYTHON_VERSION, gguf_path
from decoder.engines.smollm2 import (
    ModelFetchError,
    has_drafter,
    smollm2_drafter_gguf,
    smollm2_gguf,
    smollm2_peer_gguf,
)
from decoder.stats import DecodeStats, MethodEntry

PEERS = ("llama.cpp",)
PEER_DEPLOYMENTS = ("demo", "smollm2")
LLAMA_AR = "llama.cpp-ar"
LLAMA_AR_Q4_1 = "llama.cpp-ar-q4_1"  # smollm2: AR on the original Q4_1 GGUF
LLAMA_PREFIX = "llama.cpp-"
# Types whose drafter is a model of a kind the bench's deployments do not have.
NEEDS_OTHER_MODEL = {
    "draft-eagle3": "needs an EAGLE-3 draft head GGUF; the deployment has a plain draft model",
    "draft-mtp": "needs a target GGUF with MTP layers; the deployment's target has none",
    "draft-dflash": "needs a DFlash drafter GGUF; the deployment has none",
    "draft-dspark": "needs a DSpark drafter GGUF; the deployment has none",
}
GGUF_TYPE = {"bfloat16": "bf16", "float32": "f32"}


class PeerError(ValueError):
    """A peer cannot run as asked (unknown peer, no GGUF of the deployment); the message names the fix."""


@dataclass(frozen=True)
class PeerSettings:
    """What `--peers llama.cpp` runs: the GGUFs, which speculative types (None: all that run), draft length,
    threads."""

    target: Path
    drafter: Path | None
    spec_types: tuple[str, ...] | None = None
    draft_n_max: int = 3
    threads: int = 2
    # More llama.cpp AR rows on other GGUFs of the target (name, path, extra server flags): each its own
    # reference, compared with llama.cpp AR for information.
    other_ar: tuple[tuple[str, Path, tuple[str, ...]], ...] = ()


def is_peer(name: str) -> bool:
    return name.startswith(LLAMA_PREFIX)


def peer_settings(peers: tuple[str, ...], deployment: str, dtype: str, spec_types: tuple[str, ...] | None,
                  draft_n_max: int, threads: int | None = None) -> PeerSettings | None:
    """Settings for `--peers` (None when no peer is asked for). EngineNotBuilt when llama.cpp is not built;
    PeerError for an unknown peer, a deployment without GGUFs or a dtype without a GGUF. `threads` None: as
    many as torch uses here, so both engines get the same."""
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise PeerError(f"--peers: unknown {', '.join(bad)}; choose from {', '.join(PEERS)}")
    if not peers:
        return None
    require_built()
    if deployment not in PEER_DEPLOYMENTS:
        raise PeerError(f"--peers llama.cpp: GGUFs exist for --deployment {' and '.join(PEER_DEPLOYMENTS)} only "
                        f"(got {deployment}); drop --peers")
    if dtype not in GGUF_TYPE:
        raise PeerError(f"--peers llama.cpp: no {dtype} GGUF of the {deployment} target; use --dtype bfloat16 or "
                        f"float32")
    other_ar: tuple[tuple[str, Path, tuple[str, ...]], ...] = ()
    if deployment == "smollm2":
        try:  # the weights our engine runs, at the bench's dtype, and the Q4_1 file users run
            target = smollm2_peer_gguf(GGUF_TYPE[dtype])
            drafter = smollm2_drafter_gguf() if has_drafter() else None
            # --no-repack: the native build's repacked (AMX) Q4_1 kernels die with an illegal instruction on
            # this VM (README, LLM agents on local endpoints); the plain Q4_1 kernels are what most CPUs run.
            other_ar = ((LLAMA_AR_Q4_1, smollm2_gguf(), ("--no-repack",)),)
        except ModelFetchError as e:
            raise PeerError(f"--peers llama.cpp: smollm2: {e}") from None
    else:
        target, drafter = gguf_path("target", GGUF_TYPE[dtype]), gguf_path("drafter", GGUF_TYPE[dtype])
        if not target.is_file() or not drafter.is_file():
            raise EngineNotBuilt(f"the demo GGUFs are missing (looked for {target}); run `make llama-cpp` first")
    if threads is None:
        import torch  # only now: the checks above answer without it

        threads = torch.get_num_threads()
    return PeerSettings(target, drafter, spec_types, draft_n_max, threads, other_ar)


class PeerGroup:
    """The llama.cpp servers of one bench run, as a context manager: entering starts them (a speculative type
    that fails to start is skipped with its one-line error; llama.cpp AR failing is an EngineError), leaving
    stops every one, exceptions included. `servers` maps method names to running engines."""

    def __init__(self, settings: PeerSettings) -> None:
        self.settings = settings
        self.servers: dict[str, LlamaServer] = {}
        self.skipped: list[dict] = []

    def __enter__(self) -> PeerGroup:
        try:
            self.servers, self.skipped = _peer_methods(self.settings)
            for name in list(self.servers):
                try:
                    self.servers[name].start()
                except EngineError as exc:
                    if name == LLAMA_AR:
                        raise
                    self.servers.pop(name).stop()
                    self.skipped.append({"name": name, "reason": f"did not start: {exc}"})
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()

    @property
    def ar(self) -> LlamaServer:
        return self.servers[LLAMA_AR]

    def is_other_ar(self, name: str) -> bool:
        """An AR row on another GGUF (smollm2's Q4_1): its own reference, not checked against llama.cpp AR."""
        return any(name == n for n, _path, _flags in self.settings.other_ar)

    def info(self) -> dict:
        """What the report says about the peers: engine, GGUFs, threads, how requests are timed."""
        s = self.settings
        return {"engine": "llama.cpp", "source": f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist (vendored)",
                "target_gguf": str(s.target), "drafter_gguf": str(s.drafter) if s.drafter else None,
                **({"other_ar_gguf": {n: str(p) for n, p, _flags in s.other_ar}} if s.other_ar else {}),
                "threads": s.threads, "draft_n_max": s.draft_n_max,
                "timing": "wall time around each /completion request (prompt prefill included), cache_prompt false",
                "reference": LLAMA_AR, "methods": {n: srv.spec.flags() for n, srv in self.servers.items()}}


def _peer_methods(settings: PeerSettings) -> tuple[dict[str, LlamaServer], list[dict]]:
    """One (not yet started) server per llama.cpp method, and the skipped types with their reasons."""
    available = server_spec_types()
    wanted = settings.spec_types
    if wanted is not None:
        bad = [t for t in wanted if t not in available or t == "none"]
        if bad:
            raise PeerError(f"--peer-spec-types: unknown {', '.join(bad)}; this llama-server has "
                            f"{', '.join(t for t in available if t != 'none')}")
    server = ServerSettings(threads=settings.threads)
    servers = {LLAMA_AR: LlamaServer(settings.target, SpecSettings(), server, LLAMA_AR)}
    servers.update({name: LlamaServer(path, SpecSettings(), replace(server, extra=(*server.extra, *flags)), name)
                    for name, path, flags in settings.other_ar})
    skipped = []
    for t in available:
        if t == "none" or (wanted is not None and t not in wanted):
            continue
        name = LLAMA_PREFIX + t
        if t in NEEDS_OTHER_MODEL:
            skipped.append({"name": name, "reason": NEEDS_OTHER_MODEL[t]})
        elif t.startswith("draft-"):
            if settings.drafter is None:
                skipped.append({"name": name, "reason": "needs a draft model; the deployment has none"})
                continue
            servers[name] = LlamaServer(settings.target, SpecSettings(t, settings.drafter, settings.draft_n_max),
                                        server, name)
        else:
            servers[name] = LlamaServer(settings.target, SpecSettings(t), server, name)
    return servers, skipped


def runner(engine: Engine, max_new_tokens: int) -> Callable[[list[int]], tuple[list[int], DecodeStats]]:
    """A bench method: greedy tokens and stats (new tokens, drafted/accepted as the engine reports them)."""

    def run(prompt: list[int]) -> tuple[list[int], DecodeStats]:
        done = engine.generate(prompt, max_new_tokens)
        return done.tokens, DecodeStats(new_tokens=len(done.tokens), drafted=done.drafted, accepted=done.accepted,
                                        draft_steps=int(done.drafted > 0))

    return run


def check_against_ar(ar: Engine, prompt_ids: list[list[int]], prompt_names: list[str], outputs: list[list[int]],
                     reference: list[list[int]], floor: float) -> dict:
    """A llama.cpp method's outputs against llama.cpp AR's: mismatched prompts, and the divergences with
    llama.cpp AR's top-2 margin at each (explained when a near tie at the deployment's noise floor)."""
    mismatched, unexplained, divergences = 0, 0, []
    for pid, ids, out, ref in zip(prompt_names, prompt_ids, outputs, reference, strict=True):
        pos = first_divergence(out, ref)
        if pos is None:
            continue
        mismatched += 1
        margin = ar.score(ids + ref[:pos])[0].margin if pos < len(ref) else float("inf")
        explained = near_tie(margin, floor)
        unexplained += not explained
        divergences.append({"prompt": pid, "position": pos,
                            "margin": round(margin, 5) if margin is not None else None, "explained": explained})
    return {"reference": LLAMA_AR, "identical_to_reference": mismatched == 0, "mismatched_prompts": mismatched,
            "unexplained_mismatches": unexplained, "divergences": divergences}


def peer_entry(entry: MethodEntry, stats: DecodeStats, check: dict | None, flags: list[str],
               own_reference: dict | None = None) -> dict:
    """Turn the bench's generic entry for a llama.cpp method into its report: the lossless fields against
    llama.cpp AR (kept against hf-greedy under `vs_hf_greedy`, for information), no forward counts (the server
    does not report them), acceptance where it drafts, and the flags it ran with. `own_reference`: an AR row on
    another GGUF (its check against llama.cpp AR, kept under `vs_llama_cpp_ar` for information)."""
    vs_hf = {"identical_to_hf_greedy": entry.identical_to_hf_greedy, "mismatched_prompts": entry.mismatched_prompts,
             "unexplained_mismatches": entry.unexplained_mismatches, "divergences": entry.divergences}
    out = replace(entry, tau=None, target_forwards=None, target_forwards_per_token=None,
                  acceptance_rate=round(stats.acceptance_rate, 4) if stats.drafted else None)
    out.extra = {**entry.extra, "engine": "llama.cpp", "server_flags": flags, "vs_hf_greedy": vs_hf,
                 "drafted": stats.drafted, "accepted": stats.accepted}
    if check is not None:  # speculative: checked against llama.cpp AR
        out.extra.update({"checked_against": check["reference"],
                          "identical_to_reference": check["identical_to_reference"]})
        out.mismatched_prompts, out.unexplained_mismatches, out.divergences = (
            check["mismatched_prompts"], check["unexplained_mismatches"], check["divergences"])
    else:  # llama.cpp AR is the reference of its engine; its agreement with hf-greedy stays under vs_hf_greedy
        out.extra.update({"checked_against": entry.name if own_reference else LLAMA_AR,
                          "identical_to_reference": True})
        if own_reference is not None:
            out.extra["vs_llama_cpp_ar"] = {k: own_reference[k] for k in
                                            ("mismatched_prompts", "unexplained_mismatches", "divergences")}
        out.mismatched_prompts, out.unexplained_mismatches, out.divergences = 0, 0, []
    return out.as_dict()
