"""The LLM endpoint's wire: what it can take (context size, tool calls) and one streamed chat request that
can be cancelled.

    info = probe(base_url, api_key, model)            # EndpointInfo: context tokens and where they came from
    reply = stream_chat(url, headers, body, first_token_s=60, total_s=300, stop=event)

`probe` asks, with short timeouts, the places local servers say how large their context is: llama.cpp's
`GET /props` (`n_ctx`, and whether its chat template takes tools), Ollama's `POST /api/show` (`num_ctx` when
the model sets one, else Ollama's default window), LM Studio's `GET /api/v0/models` (`loaded_context_length`)
and `GET /v1/models` (vLLM's `max_model_len`, llama.cpp's `meta.n_ctx`, `context_length` elsewhere). A hosted
API answers none of these; the first overflow error then says the size (`context_from_error`).

`stream_chat` owns its socket: a request that passes its first-token or total deadline, or whose `stop` is
set, is cancelled by shutting the socket down, so the server sees the client leave at once and stops working
on it (llama.cpp checks between batches) before any retry is sent. The proxy in `https_proxy`/`http_proxy`
is used as urllib does (CONNECT for https).
"""

from __future__ import annotations

import http.client
import json
import queue
import re
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
OLLAMA_DEFAULT_CONTEXT = 4096  # what Ollama serves when neither the model nor OLLAMA_CONTEXT_LENGTH sets num_ctx
POLL_S = 0.1  # how often a waiting request looks at its stop event


@dataclass
class EndpointInfo:
    context_tokens: int | None = None  # None: the endpoint did not say
    source: str = ""  # where context_tokens came from, for the ledger
    tool_calls: bool | None = None  # None: unknown (try tools); False: the chat template cannot take tools


@dataclass
class Reply:
    """One streamed completion, assembled."""

    content: str = ""
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # {"id", "name", "arguments"}
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None  # llama.cpp's prompt/predicted counts and rates
    first_token_s: float = 0.0  # request sent to first content or tool-call delta
    total_s: float = 0.0


class RequestError(Exception):
    """A request that did not complete; `retryable` for timeouts, connection errors, 5xx and 429."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False,
                 body: str = "", kind: str = "") -> None:
        super().__init__(message)
        self.status, self.retryable, self.body, self.kind = status, retryable, body, kind


# -- context size ------------------------------------------------------------------------------------------------


def server_root(base_url: str) -> str:
    """The server's root for its native routes: base_url without a trailing /v1."""
    return re.sub(r"/v1/?$", "", base_url.rstrip("/"))


def probe(base_url: str, api_key: str, model: str, timeout: float = PROBE_TIMEOUT_S) -> EndpointInfo:
    """What the endpoint says about its context size and tool calls (see the module docstring)."""
    root = server_root(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    props = _get_json("GET", root + "/props", headers, None, timeout)
    if isinstance(props, dict):
        n = _int((props.get("default_generation_settings") or {}).get("n_ctx")) or _int(props.get("n_ctx"))
        caps = props.get("chat_template_caps") or {}
        tools = caps.get("supports_tool_calls") if isinstance(caps.get("supports_tool_calls"), bool) else None
        if n:
            return EndpointInfo(n, "llama.cpp /props", tools)
    show = _get_json("POST", root + "/api/show", headers, {"model": model}, timeout)
    if isinstance(show, dict) and ("model_info" in show or "parameters" in show):
        tools = "tools" in show["capabilities"] if isinstance(show.get("capabilities"), list) else None
        m = re.search(r"(?m)^\s*num_ctx\s+(\d+)", str(show.get("parameters") or ""))
        if m:
            return EndpointInfo(int(m.group(1)), "Ollama /api/show num_ctx", tools)
        trained = next((_int(v) for k, v in (show.get("model_info") or {}).items()
                        if k.endswith(".context_length")), None)
        n = min(trained or OLLAMA_DEFAULT_CONTEXT, OLLAMA_DEFAULT_CONTEXT)
        return EndpointInfo(n, f"Ollama default window (model trained for {trained or '?'})", tools)
    lms = _get_json("GET", root + "/api/v0/models", headers, None, timeout)
    entry = _model_entry(lms, model)
    n = _int(entry.get("loaded_context_length")) or _int(entry.get("max_context_length"))
    if n:
        return EndpointInfo(n, "LM Studio /api/v0/models", None)
    entry = _model_entry(_get_json("GET", base_url.rstrip("/") + "/models", headers, None, timeout), model)
    for key, src in (("max_model_len", "vLLM /v1/models"), ("context_length", "/v1/models context_length"),
                     ("context_window", "/v1/models context_window")):
        if _int(entry.get(key)):
            return EndpointInfo(_int(entry.get(key)), src, None)
    if _int((entry.get("meta") or {}).get("n_ctx")):
        return EndpointInfo(_int(entry["meta"]["n_ctx"]), "llama.cpp /v1/models", None)
    return EndpointInfo(None, "", None)


_OVERFLOW = [re.compile(p, re.I) for p in (
    r"available context size \((\d+) tokens\)",  # llama.cpp
    r"maximum context length is (\d+)",  # vLLM, OpenAI
    r"context (?:length|window|size) (?:of|is) (\d+)",
    r"n_ctx\D{0,5}(\d+)",
)]


def is_overflow(message: str) -> bool:
    """Whether an error message says the request did not fit the context."""
    return bool(re.search(r"context (size|length|window)|exceed_context|too many tokens|n_ctx", message, re.I))


def context_from_error(message: str) -> int | None:
    """The context size an overflow error names (llama.cpp, vLLM, OpenAI wordings), or None."""
    for rx in _OVERFLOW:
        m = rx.search(message)
        if m:
            return int(m.group(1))
    return None


def _int(v: Any) -> int | None:
    try:
        n = int(v)
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def _model_entry(listing: Any, model: str) -> dict[str, Any]:
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return {}
    items = [d for d in data if isinstance(d, dict)]
    named = [d for d in items if model in (d.get("id"), d.get("name"))]
    return (named or (items if len(items) == 1 else [{}]))[0]


def _get_json(method: str, url: str, headers: Mapping[str, str], body: Any, timeout: float) -> Any:
    """The JSON an endpoint answers with 200, or None (any error, any other status)."""
    conn = None
    try:
        conn, path = _connection(url, timeout)
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={**headers, **({"Content-Type": "application/json"}
                                                                       if data is not None else {})})
        resp = conn.getresponse()
        raw = resp.read(4_000_000)
        return json.loads(raw) if resp.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        if conn is not None:
            conn.close()


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection for `url` (through the environment's proxy unless bypassed) and the request path."""
    u = urlparse(url)
    https = u.scheme == "https"
    port = u.port or (443 if https else 80)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    proxy = None if urllib.request.proxy_bypass(u.hostname or "") else urllib.request.getproxies().get(u.scheme)
    if proxy:
        p = urlparse(proxy if "://" in proxy else "http://" + proxy)
        if https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                p.hostname, p.port or 80, timeout=timeout, context=ssl.create_default_context())
            conn.set_tunnel(u.hostname, port)
            return conn, path
        return http.client.HTTPConnection(p.hostname, p.port or 80, timeout=timeout), url
    if https:
        return http.client.HTTPSConnection(u.hostname, port, timeout=timeout,
                                           context=ssl.create_default_context()), path
    return http.client.HTTPConnection(u.hostname, port, timeout=timeout), path


# -- one streamed request ----------------------------------------------------------------------------------------


class _Stream(threading.Thread):
    """Sends the request and reads its server-sent events into a queue; `cancel` shuts its socket down."""

    def __init__(self, url: str, headers: Mapping[str, str], body: dict[str, Any], connect_s: float) -> None:
        super().__init__(name="llm-stream", daemon=True)
        self.url, self.headers, self.body, self.connect_s = url, dict(headers), body, connect_s
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.conn: http.client.HTTPConnection | None = None
        self.cancelled = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            conn, path = _connection(self.url, self.connect_s)
            with self.lock:
                self.conn = conn
                if self.cancelled.is_set():
                    return
            conn.connect()
            if conn.sock is not None:
                conn.sock.settimeout(None)  # the waiting side keeps the deadlines, and cancels
            data = json.dumps(self.body).encode()
            conn.request("POST", path, body=data, headers={**self.headers, "Content-Type": "application/json",
                                                           "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                self.events.put(("status", (resp.status, resp.read(100_000).decode(errors="replace"))))
                return
            if "text/event-stream" not in (resp.getheader("Content-Type") or ""):
                self.events.put(("whole", json.loads(resp.read())))  # a server that ignored stream: true
                return
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    self.events.put(("chunk", json.loads(payload)))
                elif line.startswith(b"error:"):
                    self.events.put(("chunk", {"error": json.loads(line[6:].strip() or b"{}")}))
            self.events.put(("end", None))
        except Exception as e:  # noqa: BLE001 - a cancel closes the connection under the reader: any error then
            if not self.cancelled.is_set():
                self.events.put(("error", e))
        finally:
            self.events.put(("end", None))

    def cancel(self) -> None:
        """Close the connection now: shut the socket down (wakes the reader, tells the server) and close it."""
        with self.lock:
            self.cancelled.set()
            conn = self.conn
        if conn is None:
            return
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - the reader may be closing it at the same moment
            pass


def stream_chat(url: str, headers: Mapping[str, str], body: dict[str, Any], *, first_token_s: float,
                total_s: float, stop: threading.Event | None = None) -> Reply:
    """POST a chat completion with stream: true and assemble the reply; RequestError when it does not complete.

    The request is cancelled (its socket shut down) when no content or tool-call delta has arrived after
    `first_token_s`, when the whole reply is not in after `total_s`, or when `stop` is set.
    """
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    s = _Stream(url, headers, body, connect_s=max(0.1, min(first_token_s, 30.0)))
    s.start()
    reply = Reply()
    calls: dict[int, dict[str, str]] = {}
    first = False
    try:
        while True:
            now = time.monotonic()
            deadline = t0 + (total_s if first else min(first_token_s, total_s))
            if stop is not None and stop.is_set():
                raise RequestError("stopped by the engineer", kind="stopped")
            if now >= deadline:
                what = (f"no reply in {total_s:g} s" if first or total_s <= first_token_s
                        else f"no first token in {first_token_s:g} s")
                raise RequestError(f"timed out ({what})", retryable=True, kind="timeout")
            try:
                kind, ev = s.events.get(timeout=min(POLL_S, deadline - now))
            except queue.Empty:
                continue
            if kind == "status":
                status, text = ev
                raise RequestError(f"HTTP {status}: {_error_text(text)}", status=status, body=text,
                                   retryable=status >= 500 or status == 429, kind="status")
            if kind == "error":
                raise RequestError(f"connection error ({' '.join(str(ev).split()) or type(ev).__name__})",
                                   retryable=True, kind="connection")
            if kind == "end":
                break
            if kind == "whole":
                s.cancel()
                return _whole(ev, reply, time.monotonic() - t0)
            if "error" in ev:
                err = ev["error"]
                text = json.dumps(err) if not isinstance(err, str) else err
                code = _int(err.get("code")) if isinstance(err, dict) else None
                raise RequestError(f"error in the stream: {_error_text(text)}", status=code, body=text,
                                   retryable=code is None or code >= 500, kind="status")
            if ev.get("usage"):
                reply.usage = ev["usage"]
            if ev.get("timings"):
                reply.timings = ev["timings"]
            for choice in ev.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    reply.content += delta["content"]
                for tc in delta.get("tool_calls") or []:
                    c = calls.setdefault(int(tc.get("index", len(calls))), {"id": "", "name": "", "arguments": ""})
                    c["id"] = c["id"] or str(tc.get("id") or "")
                    fn = tc.get("function") or {}
                    c["name"] += str(fn.get("name") or "") if not c["name"] else ""
                    c["arguments"] += str(fn.get("arguments") or "")
                if (delta.get("content") or delta.get("tool_calls")) and not first:
                    first = True
                    reply.first_token_s = time.monotonic() - t0
                if choice.get("finish_reason"):
                    reply.finish_reason = choice["finish_reason"]
    except BaseException:
        s.cancel()
        raise
    s.cancel()  # the stream is done; close the connection (no keep-alive across turns)
    reply.tool_calls = [calls[k] for k in sorted(calls)]
    reply.total_s = time.monotonic() - t0
    if not first:
        reply.first_token_s = reply.total_s
    return reply


def _whole(payload: dict[str, Any], reply: Reply, seconds: float) -> Reply:
    choice = (payload.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    reply.content = msg.get("content") or ""
    reply.tool_calls = [{"id": str(tc.get("id") or ""), "name": str((tc.get("function") or {}).get("name") or ""),
                         "arguments": str((tc.get("function") or {}).get("arguments") or "")}
                        for tc in msg.get("tool_calls") or []]
    reply.finish_reason = choice.get("finish_reason")
    reply.usage, reply.timings = payload.get("usage"), payload.get("timings")
    reply.first_token_s = reply.total_s = seconds
    return reply


def _error_text(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return " ".join(text.split())[:300]
    err = data.get("error", data) if isinstance(data, dict) else data
    msg = err.get("message") if isinstance(err, dict) else err
    return " ".join(str(msg or text).split())[:300]
