"""The config contract of a llama.cpp system: `llama-server`'s flags as the keys of a workspace's `system.toml`.

A llama.cpp workspace (`specpilot init --engine llama.cpp`) runs `llama-server` behind the harness's
JSON-lines protocol (`decoder/engines/serve_llamacpp.py`). What the tuner may change is this config,
one key per server flag, with the same reader and writer as `DecodeConfig` (a `[decode]` table; a key
this schema does not know passes through to the system's own code). The registry of what the tuner
composes is `decoder/engines/llamacpp_mechanisms.toml` (read by `decoder.mechanisms.load_registry`).

0 in an integer key means "llama-server's own default" (the flag is not passed): every default of
stock is the engine's, so stock is llama.cpp as a user starts it, with speculation off unless `init
--spec-type` set it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from decoder.config import ConfigError, ConfigTable

SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple")
NGRAM_SIZED = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")  # the types with --spec-<type>-size-n/-m/-min-hits
FLASH_ATTN = ("auto", "on", "off")
LOOKUP_CACHES = ("off", "corpus")  # lookup_cache: the deployment's n-gram caches for ngram-cache (lookup_cache.py)
NGRAM_CACHE_DRAFT = 8  # llama-server's ngram-cache drafts at most 8 tokens (fixed in common/speculative.cpp)
MAX_THREADS = 256
# Flags only an engine carrying one of decoder/engines/patches/ knows (upstream llama-server refuses them): the
# flag, and the patch that adds it (patches.toml's name). Workspace.refusal holds a config that needs one to the
# engine source of the commit it runs on.
NGRAM_CACHE_N_MAX_FLAG = "--spec-ngram-cache-n-max"
PATCHED_FLAGS = {NGRAM_CACHE_N_MAX_FLAG: "llama-ngram-cache-n-max"}


@dataclass
class LlamaCppConfig(ConfigTable):
    LABEL = "llama.cpp config"

    spec_type: str = "none"  # llama-server --spec-type; "none": no speculation (llama.cpp AR)
    draft_n_max: int = 0  # --spec-draft-n-max (ngram-mod: --spec-ngram-mod-n-max): most tokens drafted per step
    draft_n_min: int = 0  # --spec-draft-n-min (ngram-mod: --spec-ngram-mod-n-min: a shorter match drafts nothing)
    draft_p_min: float = 0.0  # --spec-draft-p-min: a draft-model token below this probability ends the draft
    ngram_size_n: int = 0  # --spec-<type>-size-n (ngram-mod: --spec-ngram-mod-n-match): the lookup length
    ngram_size_m: int = 0  # --spec-<type>-size-m: the draft length of an n-gram type (0: default)
    ngram_min_hits: int = 0  # --spec-<type>-min-hits (0: default, 1)
    # ngram-cache only: "corpus" loads the deployment's n-gram caches made from its own answers
    # (--lookup-cache-dynamic/-static, decoder/engines/lookup_cache.py); "off": the request's own text only
    lookup_cache: str = "off"
    threads: int = 0  # --threads and --threads-batch (0: all cores, the engine's default)
    batch_size: int = 0  # --batch-size, the logical batch (0: default 2048)
    ubatch_size: int = 0  # --ubatch-size, the physical batch (0: default 512)
    flash_attn: str = "auto"  # --flash-attn on|off|auto
    poll: int = -1  # --poll 0..100: how hard idle threads spin for work (-1: default, 50)
    ctx_size: int = 4096  # --ctx-size: prompt + output tokens one request may hold
    device: str = "cpu"  # where the server runs (the tuner's device filter); CPU builds only for now
    dtype: str = "gguf"  # the weights are the GGUF file's; fixed

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(key: str, fix: str) -> ConfigError:
            return ConfigError(f"llama.cpp config: {key} = {getattr(self, key)!r}: {fix}")

        if self.spec_type not in SPEC_TYPES:
            raise bad("spec_type", f"choose one of {', '.join(SPEC_TYPES)}")
        for key, top in (("draft_n_max", 64), ("draft_n_min", 64), ("ngram_size_n", 64), ("ngram_size_m", 64),
                         ("ngram_min_hits", 64), ("threads", MAX_THREADS), ("batch_size", 1 << 16),
                         ("ubatch_size", 1 << 16)):
            if not 0 <= getattr(self, key) <= top:
                raise bad(key, f"use 0 (the engine's default) to {top}")
        if self.draft_n_max and self.draft_n_min > self.draft_n_max:
            raise bad("draft_n_min", f"must not exceed draft_n_max = {self.draft_n_max}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise bad("draft_p_min", "use a probability from 0.0 to 1.0")
        if self.lookup_cache not in LOOKUP_CACHES:
            raise bad("lookup_cache", f"choose one of {', '.join(LOOKUP_CACHES)}")
        if self.flash_attn not in FLASH_ATTN:
            raise bad("flash_attn", f"choose one of {', '.join(FLASH_ATTN)}")
        if not (self.poll == -1 or 0 <= self.poll <= 100):
            raise bad("poll", "use -1 (the engine's default) or 0 to 100")
        if not 64 <= self.ctx_size <= 1 << 20:
            raise bad("ctx_size", "use 64 to 1048576 tokens")
        if self.batch_size and self.ubatch_size and self.ubatch_size > self.batch_size:
            raise bad("ubatch_size", f"must not exceed batch_size = {self.batch_size}")
        if self.device != "cpu":
            raise bad("device", "this llama.cpp build runs on the CPU; use cpu")
        if self.dtype != "gguf":
            raise bad("dtype", "the weights are the GGUF file's; use gguf")

    @property
    def method(self) -> str:
        """"sd" when the server speculates, as DecodeConfig names it (the loop's AR reference sets spec_type none)."""
        return "ar" if self.spec_type == "none" else "sd"

    def verify_width(self) -> int:
        """Tokens one verify forward may hold: 1 + the most this config drafts per step (the engine's defaults:
        draft_n_max 3, n-gram size_m 48, ngram-mod n_max 64, ngram-cache 8)."""
        if self.spec_type == "none":
            return 1
        if self.spec_type == "ngram-cache":
            return 1 + (self.draft_n_max or NGRAM_CACHE_DRAFT)
        if self.spec_type in NGRAM_SIZED:
            return 1 + (self.ngram_size_m or 48)
        return 1 + (self.draft_n_max or (64 if self.spec_type == "ngram-mod" else 3))

    def spec_flags(self, drafter: Path | None, lookup_cache: Path | None = None) -> list[str]:
        """llama-server's speculative flags for this config (`drafter`: the draft model's GGUF, for draft-simple;
        `lookup_cache`: the deployment's folder of n-gram caches, dynamic.bin and static.bin, for lookup_cache =
        "corpus", which other spec types ignore)."""
        if self.spec_type == "none":
            return []
        out = ["--spec-type", self.spec_type]
        if self.spec_type == "ngram-cache" and self.lookup_cache == "corpus":
            if lookup_cache is None:
                raise ConfigError("llama.cpp config: lookup_cache = 'corpus' needs the deployment's n-gram caches; "
                                  "this workspace has none (set lookup_cache = 'off')")
            out += ["--lookup-cache-dynamic", str(lookup_cache / "dynamic.bin"),
                    "--lookup-cache-static", str(lookup_cache / "static.bin")]
        if self.spec_type == "draft-simple":
            if drafter is None:
                raise ConfigError("llama.cpp config: spec_type = 'draft-simple' needs a draft model; this workspace "
                                  "has none (choose an n-gram type)")
            out += ["--spec-draft-model", str(drafter)]
        # ngram-mod has bounds and a lookup length of its own (llama.cpp's common/speculative.cpp ignores the
        # --spec-draft-n-* flags for it); the other n-gram types draft size_m tokens.
        mod = self.spec_type == "ngram-mod"
        # ngram-cache drafts up to 8 tokens in upstream llama.cpp; its cap is a flag of the patched engine only
        cap = NGRAM_CACHE_N_MAX_FLAG if self.spec_type == "ngram-cache" else "--spec-draft-n-max"
        for key, flag in (("draft_n_max", "--spec-ngram-mod-n-max" if mod else cap),
                          ("draft_n_min", "--spec-ngram-mod-n-min" if mod else "--spec-draft-n-min"),
                          *((("ngram_size_n", "--spec-ngram-mod-n-match"),) if mod else ())):
            if getattr(self, key):
                out += [flag, str(getattr(self, key))]
        if self.draft_p_min:
            out += ["--spec-draft-p-min", repr(self.draft_p_min)]
        if self.spec_type in NGRAM_SIZED:
            for key, suffix in (("ngram_size_n", "size-n"), ("ngram_size_m", "size-m"), ("ngram_min_hits", "min-hits")):
                if getattr(self, key):
                    out += [f"--spec-{self.spec_type}-{suffix}", str(getattr(self, key))]
        return out

    def patched_flags(self) -> list[str]:
        """The flags of this config that upstream llama-server lacks (PATCHED_FLAGS): they need an engine built
        from a source tree carrying their patch."""
        out = []
        if self.spec_type == "ngram-cache" and self.draft_n_max:
            out.append(NGRAM_CACHE_N_MAX_FLAG)
        return out

    def server_flags(self) -> list[str]:
        """Everything else: threads, batches, attention, polling and context."""
        out = ["--ctx-size", str(self.ctx_size), "--flash-attn", self.flash_attn]
        if self.threads:
            out += ["--threads", str(self.threads), "--threads-batch", str(self.threads)]
        if self.batch_size:
            out += ["--batch-size", str(self.batch_size)]
        if self.ubatch_size:
            out += ["--ubatch-size", str(self.ubatch_size)]
        if self.poll >= 0:
            out += ["--poll", str(self.poll)]
        return out



def main(argv: list[str] | None = None) -> int:
    """`python -m decoder.engines.llamacpp_config SYSTEM_TOML [--drafter D.gguf]`: the llama-server flags of a
    llama.cpp workspace's config (stock's, or what the loop kept), to run it outside SpecPilot."""
    p = argparse.ArgumentParser(prog="python -m decoder.engines.llamacpp_config", description=main.__doc__)
    p.add_argument("config", type=Path, help="a llama.cpp workspace's system.toml")
    p.add_argument("--drafter", type=Path, default=None, help="the draft model's GGUF (spec_type draft-simple)")
    p.add_argument("--lookup-cache", type=Path, default=None,
                   help="the deployment's n-gram cache folder (lookup_cache = 'corpus')")
    args = p.parse_args(argv)
    try:
        cfg = LlamaCppConfig.load(args.config)
        flags = [*cfg.server_flags(), *cfg.spec_flags(args.drafter, args.lookup_cache)]
    except OSError as e:
        print(f"error: {args.config}: cannot read it ({e.strerror})", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 2
    print(shlex.join(flags))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
