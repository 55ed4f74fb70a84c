"""llama.cpp's `llama-server` as an engine: start, generate greedily from token ids, score positions, stop.

`LlamaServer(model, spec=SpecSettings(...))` starts the server built by `make llama-cpp`
(decoder/engines/llamacpp_build.py) on 127.0.0.1 with a free port, in a process group of its own that dies
with its parent (PR_SET_PDEATHSIG), and waits for `/health`. `stop()` (also on exceptions, through the
context manager, and at interpreter exit) kills the whole group: no orphan servers.

Requests go to the native `/completion` endpoint with the prompt as token ids, `n_predict`,
`temperature 0` and `top_k 1` (greedy), `return_tokens` (ids out, no detokenising), and:

- `cache_prompt: false` in `generate`: every request prefills its whole prompt, as our bench's methods do
  (the timing is the wall time around the HTTP request, prefill and transport included); `score` sets it
  true, since it asks about one prefix after another and is not timed.
- `n_probs: 2` only in `score` (untimed; asking for probabilities costs a softmax over the vocabulary per
  token). llama.cpp returns the top tokens' *log-probabilities* of the softmax over the raw logits
  (`post_sampling_probs` false); log p1 - log p2 = logit1 - logit2, so the top-2 logit margin is exact up
  to float32 rounding (about 1e-6 here). Where p2 underflows to 0 the server reports the lowest float, and
  the margin is huge: never a near tie, which is right. The absolute logits are not recoverable.

Speculative decoding is set when the server starts (per-request speculative fields are compiled out of
this version): `SpecSettings(type="draft-simple", draft_model=..., n_max=3)` passes `--spec-type`,
`--spec-draft-model` (`-md`), `--spec-draft-n-max/--spec-draft-n-min`, and any extra flags verbatim.
`server_spec_types()` lists the types the built binary accepts (from its `--help`).

Another OpenAI-compatible engine plugs in the same way, as a subclass of `decoder.engines.Engine`:
- vLLM: `vllm serve MODEL --host 127.0.0.1 --port P` (speculation: `--speculative-config '{"method":
  "ngram"|"eagle"|..., "num_speculative_tokens": k, "model": DRAFTER}'`), health at `GET /health`;
  generate with `POST /v1/completions` {"prompt": [ids], "max_tokens": n, "temperature": 0,
  "return_tokens_as_token_ids": true}, reading ids from `choices[0].logprobs.tokens` ("token_id:N");
  margins with "logprobs": 2 (top-2 log-probabilities; with `--logprobs-mode raw_logprobs`, the default in
  the V1 engine, their difference is the logit margin, as here) and "prompt_logprobs" to score a forced
  continuation in one request instead of one per position.
- SGLang: `python -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port P`
  (`--speculative-algorithm EAGLE|NGRAM ...`), health at `GET /health`; `POST /generate` {"input_ids":
  [ids], "sampling_params": {"max_new_tokens": n, "temperature": 0}, "return_logprob": true,
  "top_logprobs_num": 2}, ids from `meta_info.output_token_logprobs`.
Both need: token ids in and out (no re-tokenising), greedy sampling, top-2 log-probabilities of the raw
distribution, a health endpoint, their speculative flags fixed at launch (so one server per
configuration, as here), and a process group to stop. On a GPU their timing also includes the device
sync the server does before answering, which is what a user sees.
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from decoder.engines import Completion, Engine, EngineError, EngineNotBuilt, Score
from decoder.engines.llamacpp_build import binary, is_built, missing_build_message

DEFAULT_THREADS = 2
HEALTH_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SpecSettings:
    """llama-server's speculative flags. `type` None: speculation off (llama.cpp AR)."""

    type: str | None = None
    draft_model: Path | None = None
    n_max: int | None = None
    n_min: int | None = None
    extra: tuple[str, ...] = ()

    def flags(self) -> list[str]:
        if self.type is None:
            return list(self.extra)
        out = ["--spec-type", self.type]
        if self.draft_model is not None:
            out += ["--spec-draft-model", str(self.draft_model)]
        if self.n_max is not None:
            out += ["--spec-draft-n-max", str(self.n_max)]
        if self.n_min is not None:
            out += ["--spec-draft-n-min", str(self.n_min)]
        return out + list(self.extra)


@dataclass
class ServerSettings:
    """How a server runs: CPU threads for decode and for prompt batches, context size, extra flags."""

    threads: int = DEFAULT_THREADS
    ctx_size: int = 2048
    extra: tuple[str, ...] = field(default_factory=tuple)

    def flags(self) -> list[str]:
        return ["--threads", str(self.threads), "--threads-batch", str(self.threads), "--ctx-size",
                str(self.ctx_size), "--parallel", "1", "--n-gpu-layers", "0", "--cache-ram", "0", *self.extra]


def require_built() -> None:
    """An EngineNotBuilt naming `make llama-cpp` when the binaries are not in the cache."""
    if not is_built():
        raise EngineNotBuilt(missing_build_message())


def server_spec_types() -> list[str]:
    """The `--spec-type` values the built `llama-server` accepts, read from its `--help`."""
    require_built()
    out = subprocess.run([str(binary("llama-server")), "--help"], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    m = re.search(r"--spec-type\s+\[?([a-z0-9,|\-]+)\]?", out.stdout + out.stderr)
    if not m:
        raise EngineError("llama-server --help does not list --spec-type values; is this llama.cpp build too old?")
    return [t for t in re.split(r"[,|]", m.group(1)) if t]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


try:  # loaded here, not in the forked child: the child runs as little Python as possible before exec
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: stop() and atexit still stop the server
    _PRCTL = None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux PR_SET_PDEATHSIG), so a killed bench
    leaves no server. The signal follows the thread that started the server: start servers from a thread
    that outlives them (the bench does, from its main thread)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)


_LIVE: weakref.WeakSet[LlamaServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class LlamaServer(Engine):
    """One `llama-server` process serving `model` with the given speculative settings."""

    def __init__(self, model: Path, spec: SpecSettings | None = None, settings: ServerSettings | None = None,
                 name: str | None = None, log_dir: Path | None = None, *, server: Path | None = None,
                 unix_socket: Path | None = None) -> None:
        self.model = Path(model)
        self.server = Path(server) if server is not None else None  # the binary; None: the cache's (make llama-cpp)
        # Listen on this UNIX socket instead of a TCP port (inside the sandbox, whose loopback is down).
        self.unix_socket = Path(unix_socket) if unix_socket is not None else None
        self.spec = spec or SpecSettings()
        self.settings = settings or ServerSettings()
        self.name = name or ("llama.cpp-ar" if self.spec.type is None else f"llama.cpp-{self.spec.type}")
        self.log_dir = log_dir  # the server's output; None: the system's temporary folder
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._log: Path | None = None
        self._conn: http.client.HTTPConnection | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------

    def command(self, port: int) -> list[str]:
        where = (["--host", str(self.unix_socket)] if self.unix_socket is not None else
                 ["--host", "127.0.0.1", "--port", str(port)])
        return [str(self.server or binary("llama-server")), "--model", str(self.model), *where,
                *self.settings.flags(), *self.spec.flags()]

    def start(self) -> None:
        if self.server is None:
            require_built()
        elif not os.access(self.server, os.X_OK):
            raise EngineNotBuilt(f"{self.name}: no llama-server binary at {self.server}; run `make llama-cpp`")
        for path in (self.model, self.spec.draft_model):
            if path is not None and not Path(path).is_file():
                raise EngineError(f"{self.name}: no model file at {path}; run `make llama-cpp` to convert the demo "
                                  f"models")
        last = ""
        for _ in range(3):  # a free port can be taken between our probe and the server's bind
            last = self._start_once()
            if not last:
                return
            if "bind" not in last.lower() and "address" not in last.lower():
                break
        raise EngineError(last)

    def _start_once(self) -> str:
        """Start and wait for health; '' when it answers, else why not (the process is gone then)."""
        self.port = _free_port() if self.unix_socket is None else None
        if self.unix_socket is not None:
            self.unix_socket.unlink(missing_ok=True)
        fd, log = tempfile.mkstemp(prefix=f"specpilot-{self.name}-", suffix=".log", dir=self.log_dir)
        self._log = Path(log)
        cmd = self.command(self.port)
        with os.fdopen(fd, "w") as fh:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            self._proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, preexec_fn=_die_with_parent)
        _LIVE.add(self)
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                why = self._last_log_line()
                rc = self._proc.returncode
                self._kill()
                return f"{self.name}: llama-server exited with status {rc} at start: {why} (log: {self._log})"
            try:
                status, _ = self._request("GET", "/health", timeout=2.0)
            except (OSError, http.client.HTTPException):
                status = None
            if status == 200:
                return ""
            time.sleep(0.05)
        self._kill()
        return f"{self.name}: llama-server did not become healthy in {HEALTH_TIMEOUT_S:.0f} s (log: {self._log})"

    def _death(self) -> str:
        """Why the server is gone, when it died: a SIGILL names the usual cause and the flag that avoids it."""
        proc = self._proc
        if proc is None or proc.poll() is None:
            return ""
        if proc.returncode == -signal.SIGILL:
            return ("; llama-server died of SIGILL (an instruction this CPU or VM does not run, e.g. AMX in the "
                    "repacked quantised kernels): start it with --no-repack (ServerSettings(extra=('--no-repack',)))")
        return f"; llama-server exited with status {proc.returncode}"

    def _last_log_line(self) -> str:
        try:
            lines = [ln.strip() for ln in self._log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
        return (errors or lines or ["no output"])[-1][:300]

    def _kill(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        else:  # the leader is gone; anything it left in the group goes too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _LIVE.discard(self)

    def stop(self) -> None:
        ok = self._proc is not None
        self._kill()
        if ok and self._log is not None:  # a clean stop needs no log; a failed start keeps it for the user
            self._log.unlink(missing_ok=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- requests ----------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict | None = None,
                 timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, dict]:
        """One HTTP request on a kept-alive connection (reconnecting once if the server closed it)."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = (_UnixHTTPConnection(self.unix_socket, timeout) if self.unix_socket is not None else
                              http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout))
            self._conn.timeout = timeout  # a kept connection was made with an earlier call's timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
            try:
                self._conn.request(method, path, body=data, headers=headers)
                resp = self._conn.getresponse()
                raw = resp.read()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
                continue
            try:
                payload = json.loads(raw) if raw else {}
            except json.JSONDecodeError:
                payload = {"raw": raw[:200].decode(errors="replace")}
            return resp.status, payload
        raise AssertionError("unreachable")

    def _post(self, path: str, body: dict) -> dict:
        if self._proc is None:
            raise EngineError(f"{self.name}: not started")
        try:
            status, payload = self._request("POST", path, body)
        except (OSError, http.client.HTTPException) as exc:
            raise EngineError(f"{self.name}: {path} failed: {exc}{self._death()} (log: {self._log})") from None
        if status != 200:
            msg = payload.get("error", {}).get("message") if isinstance(payload.get("error"), dict) else payload
            raise EngineError(f"{self.name}: {path} answered HTTP {status}: {msg} (log: {self._log})")
        return payload

    def _completion(self, prompt: Sequence[int], n_predict: int, n_probs: int, cache_prompt: bool) -> dict:
        return self._post("/completion", {
            "prompt": [int(t) for t in prompt], "n_predict": int(n_predict), "temperature": 0.0, "top_k": 1,
            "cache_prompt": cache_prompt, "return_tokens": True, "n_probs": n_probs, "stream": False,
        })

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> Completion:
        t0 = time.perf_counter()
        out = self._completion(prompt, max_new_tokens, n_probs=0, cache_prompt=False)
        seconds = time.perf_counter() - t0
        tokens = [int(t) for t in out.get("tokens", [])]  # an end-of-sequence token stays in, as in ours
        timings = out.get("timings") or {}
        return Completion(tokens[:max_new_tokens], seconds, drafted=int(timings.get("draft_n", 0)),
                          accepted=int(timings.get("draft_n_accepted", 0)), timings=dict(timings))

    def score(self, context: Sequence[int], continuation: Sequence[int] = ()) -> list[Score]:
        scores = []
        for i in range(len(continuation) + 1):
            out = self._completion([*context, *continuation[:i]], 1, n_probs=2, cache_prompt=True)
            scores.append(_score_of(out))
        return scores

    def score_fresh(self, context: Sequence[int]) -> Score:
        """The greedy token and top-2 margin after `context` evaluated from scratch (no cached prefix: the
        whole context in prompt batches), to set beside `score`'s one-token forwards (a noise floor)."""
        return _score_of(self._completion(context, 1, n_probs=2, cache_prompt=False))

    def tokenize(self, text: str, parse_special: bool = True) -> list[int]:
        """llama.cpp's tokens for `text`: no BOS added; special tokens written in the text are parsed as such
        (as Hugging Face tokenizers do) unless `parse_special` is False."""
        out = self._post("/tokenize", {"content": text, "add_special": False, "parse_special": parse_special})
        return [int(t) for t in out["tokens"]]


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a UNIX socket (llama-server's `--host PATH.sock`)."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _score_of(out: dict) -> Score:
    """Greedy token and top-2 margin from a one-token completion with n_probs 2 (log-probabilities)."""
    probs = out.get("completion_probabilities") or []
    if not probs:
        tokens = out.get("tokens") or []
        if not tokens:
            raise EngineError("llama-server answered a one-token completion without a token")
        return Score(int(tokens[0]), None)
    first = probs[0]
    top = first.get("top_logprobs") or []
    margin = float(top[0]["logprob"]) - float(top[1]["logprob"]) if len(top) >= 2 else None
    return Score(int(first["id"]), margin)


BENCH_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)


def bench_widths(model: Path, *, threads: int, depth: int, widths: Sequence[int] = BENCH_WIDTHS, repetitions: int = 5,
                 extra: Sequence[str] = (), bench: Path | None = None, timeout_s: float = 600.0
                 ) -> tuple[dict[int, float], dict[int, float]]:
    """Forward cost of `model` at each width: `llama-bench -p W -n 0 -d DEPTH` (one forward over W tokens after
    DEPTH tokens of context) in ms, the fastest of `repetitions` (on a shared machine the others carry other
    work's time), and the standard deviation over them. `extra`: the server's fixed flags that llama-bench
    shares (`--no-repack` becomes `--repack 0`). EngineError (one line) on failure."""
    exe = Path(bench) if bench is not None else binary("llama-bench")
    if not os.access(exe, os.X_OK):
        raise EngineNotBuilt(missing_build_message())
    flags = ["--repack", "0"] if "--no-repack" in extra else []
    cmd = [str(exe), "-m", str(model), "-p", ",".join(str(w) for w in widths), "-n", "0", "-d", str(depth),
           "-t", str(threads), "-r", str(repetitions), "-o", "json", *flags]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise EngineError(f"llama-bench did not finish in {timeout_s:.0f} s: {' '.join(cmd)}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise EngineError(f"llama-bench failed ({last[:200]}): {' '.join(cmd)}")
    try:
        rows = json.loads(out.stdout)
        fastest = {int(r["n_prompt"]): min(float(x) for x in r.get("samples_ns") or [r["avg_ns"]]) / 1e6 for r in rows}
        std = {int(r["n_prompt"]): float(r["stddev_ns"]) / 1e6 for r in rows}
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"llama-bench printed no result table ({exc}): {' '.join(cmd)}") from None
    return fastest, std


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m decoder.engines.llamacpp MODEL.gguf TOKEN_ID...`: a greedy continuation (a manual check)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m decoder.engines.llamacpp MODEL.gguf TOKEN_ID...", file=sys.stderr)
        return 2
    try:
        with LlamaServer(Path(args[0])) as server:
            done = server.generate([int(t) for t in args[1:]], 32)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"tokens": done.tokens, "seconds": round(done.seconds, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
