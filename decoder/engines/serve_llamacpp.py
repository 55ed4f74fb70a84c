"""A llama.cpp system's entry point under the workbench harness: `llama-server` behind the JSON-lines protocol.

    python -m decoder.engines.serve_llamacpp --server BIN --model TARGET.gguf [--drafter DRAFT.gguf]
        [--lookup-cache DIR] --config system.toml [--server-flag FLAG ...]

The same protocol as `decoder/serve.py` (see its docstring): `{"ready": true}`, then one answer per
request line, `{"id", "tokens"}` or `{"id", "error"}`. The config is a `LlamaCppConfig`
(decoder/engines/llamacpp_config.py): llama-server's flags. Speculation is fixed when a server starts,
so a request whose `config` overrides change a flag is served by a server started with those flags;
the last MAX_SERVERS configurations stay running (a tuner alternates two of them), older ones stop.

The server listens on a UNIX socket in this process's /tmp (the sandbox has no network device up), in a
process group that dies with this process. Timing is the harness's, from outside: this adapter's own
HTTP round trip is part of the system's time, as a user's client would see it. `profile` adds the
engine's own account (prompt and decode milliseconds, drafted and accepted tokens) as DecodeStats.
Batched requests are refused in one line: this adapter serves one request at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

from decoder.config import ConfigError
from decoder.engines import Completion, EngineError
from decoder.engines.llamacpp import LlamaServer, ServerSettings, SpecSettings
from decoder.engines.llamacpp_config import LlamaCppConfig
from decoder.serve import answer, protocol_channel, read_requests
from decoder.stats import DecodeStats

MAX_SERVERS = 2
FIXED = ("dtype", "device", "max_new_tokens")  # as started / as requested, never per request


def stats_of(done: Completion) -> dict:
    """DecodeStats of one completion from llama-server's timings: prefill = prompt processing, verify = the
    decode loop (drafting included: llama.cpp does not time it apart), forwards = 1 + decode steps."""
    t = done.timings
    n = len(done.tokens)
    steps = max(0, n - 1 - done.accepted)
    st = DecodeStats(new_tokens=n, target_forwards=1 + steps if n else 0,
                     target_tokens=int(t.get("prompt_n", 0)) + steps + done.drafted,
                     draft_steps=steps if done.drafted else 0, drafted=done.drafted, accepted=done.accepted)
    st.phase_s["prefill"] = float(t.get("prompt_ms", 0.0)) / 1000.0
    st.phase_s["verify"] = float(t.get("predicted_ms", 0.0)) / 1000.0
    st.wall_s = done.seconds
    return {**st.as_dict(), "engine": {k: t[k] for k in sorted(t) if isinstance(t[k], (int, float))}}


class Servers:
    """Running llama-servers by configuration, the most recently used kept (MAX_SERVERS)."""

    def __init__(self, binary: Path, model: Path, drafter: Path | None, fixed_flags: list[str],
                 lookup_cache: Path | None = None) -> None:
        self.binary, self.model, self.drafter, self.fixed = binary, model, drafter, fixed_flags
        self.lookup_cache = lookup_cache
        self.live: OrderedDict[tuple[str, ...], LlamaServer] = OrderedDict()
        self.tmp = Path(tempfile.mkdtemp(prefix="specpilot-llama-"))
        self.started = 0

    def get(self, cfg: LlamaCppConfig) -> LlamaServer:
        flags = (*cfg.server_flags(), *cfg.spec_flags(self.drafter, self.lookup_cache), *self.fixed)
        if flags in self.live:
            self.live.move_to_end(flags)
            return self.live[flags]
        while len(self.live) >= MAX_SERVERS:
            self.live.popitem(last=False)[1].stop()
        threads = cfg.threads or len(os.sched_getaffinity(0))
        self.started += 1
        # ServerSettings passes threads and the context; the config's own flags follow (a later flag wins).
        server = LlamaServer(self.model, SpecSettings(extra=tuple(flags)),
                             ServerSettings(threads=threads, ctx_size=cfg.ctx_size),
                             name=f"llama-server-{self.started}", log_dir=self.tmp, server=self.binary,
                             unix_socket=self.tmp / f"server-{self.started}.sock")
        server.start()
        self.live[flags] = server
        return server

    def stop(self) -> None:
        for server in self.live.values():
            server.stop()
        self.live.clear()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m decoder.engines.serve_llamacpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, type=Path, help="the llama-server binary")
    p.add_argument("--model", required=True, type=Path, help="the target's GGUF file")
    p.add_argument("--drafter", type=Path, default=None, help="the draft model's GGUF file (spec_type draft-simple)")
    p.add_argument("--lookup-cache", type=Path, default=None,
                   help="the deployment's n-gram cache folder, dynamic.bin and static.bin (lookup_cache = 'corpus')")
    p.add_argument("--config", required=True, type=Path, help="system.toml: a LlamaCppConfig")
    p.add_argument("--server-flag", action="append", default=[], dest="fixed",
                   help="a flag every server gets, fixed by the deployment (e.g. --no-repack); repeatable")
    args = p.parse_args(argv)

    proto = protocol_channel()
    try:
        table_cfg = LlamaCppConfig.load(args.config)
    except (OSError, ConfigError) as e:
        print(f"serve_llamacpp: bad config {args.config}: {e}", file=sys.stderr)
        return 2
    servers = Servers(args.server, args.model, args.drafter, list(args.fixed), args.lookup_cache)
    try:
        servers.get(table_cfg)
    except (EngineError, ConfigError) as e:
        print(f"serve_llamacpp: {e}", file=sys.stderr)
        servers.stop()
        return 2
    answer(proto, {"ready": True, "config": table_cfg.as_dict()})
    try:
        for req in read_requests(sys.stdin, proto):
            rid = req.get("id")
            try:
                if req.get("batch") is not None:
                    raise ValueError("this llama.cpp system serves one request at a time; use load batch_sizes = [1]")
                prompt = [int(t) for t in req["prompt_ids"]]
                n = int(req["max_new_tokens"])
                over = {k: v for k, v in dict(req.get("config") or {}).items() if k not in FIXED}
                cfg = dataclasses.replace(table_cfg, **over) if over else table_cfg
                if len(prompt) + n > cfg.ctx_size:
                    raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({n}) exceed ctx_size "
                                     f"{cfg.ctx_size}; ask for fewer tokens or raise ctx_size in system.toml")
            except (ValueError, KeyError, TypeError) as e:  # ConfigError is a ValueError
                answer(proto, {"id": rid, "error": f"bad request: {e}".splitlines()[0][:300]})
                continue
            try:
                done = servers.get(cfg).generate(prompt, n)
                ans = {"id": rid, "tokens": done.tokens}
                if req.get("profile"):
                    ans["stats"] = stats_of(done)
                answer(proto, ans)
            except Exception as e:  # noqa: BLE001 - report the failure to the harness, keep serving
                answer(proto, {"id": rid, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
    finally:
        servers.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
