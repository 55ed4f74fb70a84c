"""A scripted OpenAI-compatible chat server: the test double for a hosted LLM (or vLLM, llama.cpp, Ollama).

A real `http.server` on 127.0.0.1 (random port) in a thread, speaking POST /v1/chat/completions. Each
request takes the next step of a script and is recorded (headers, lower-cased, and JSON body), so a test can
check what the agent sent, e.g. that an error tool result went back to the model:

    with OpenAIStub([call("list_files", path="."), http_error(500), call("finish", ...)]) as stub:
        LLMAgent(LLMConfig(base_url=stub.base_url, model="stub", api_key="sk-test")).run(ctx)
        stub.requests[1]["body"]["messages"]

A step is a reply dict (see `call`, `calls`, `say`), `http_error(status)`, `slow(seconds, step)` (the reply
comes after a sleep: longer than the client's timeout, it is a timeout), or a callable taking the request
body and returning a step (to act mid-run, e.g. inject a steering message). When the script runs out, the
`after` step (a callable or a reply) answers every further request.

A request with `stream: true` gets server-sent events, as llama.cpp, vLLM and Ollama send them: the content
and each tool call's arguments in pieces, then the finish reason, then the usage. While a `slow` step sleeps
the stub watches the connection, and records in the request's `closed_at` (time.monotonic()) when the client
went away; `arrived_at` is when the request came in. `routes` answers other paths (GET or POST) with fixed
JSON, e.g. {"/props": {"default_generation_settings": {"n_ctx": 4096}}} to play llama.cpp; other paths get
404 and are recorded in `probes`, not in `requests`.
"""

from __future__ import annotations

import itertools
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_ids = itertools.count(1)

Step = dict[str, Any] | Callable[[dict[str, Any]], Any]


def call(name: str, /, *, raw_arguments: str | None = None, tokens: int | None = None,
         **arguments: Any) -> dict[str, Any]:
    """A reply with one tool call; raw_arguments sends the arguments string as is (e.g. broken JSON)."""
    return calls([(name, raw_arguments if raw_arguments is not None else json.dumps(arguments))], tokens=tokens)


def calls(items: list[tuple[str, str]], *, tokens: int | None = None) -> dict[str, Any]:
    """A reply with several tool calls, each (name, arguments as a JSON string).

    `tokens`: the usage's total_tokens; None: the prompt counted as its JSON's characters / 4, plus 10."""
    tool_calls = [{"id": f"call_{next(_ids)}", "type": "function", "function": {"name": n, "arguments": a}}
                  for n, a in items]
    return {"reply": {"role": "assistant", "content": None, "tool_calls": tool_calls},
            "finish_reason": "tool_calls", "tokens": tokens}


def say(text: str, *, tokens: int | None = None) -> dict[str, Any]:
    """A final (plain text) reply with no tool call."""
    return {"reply": {"role": "assistant", "content": text}, "finish_reason": "stop", "tokens": tokens}


def prompt_tokens(body: dict[str, Any]) -> int:
    """The stub's token count for a request's prompt: the characters of its messages and tools as JSON / 4."""
    return (len(json.dumps(body.get("messages", []))) + len(json.dumps(body.get("tools", [])))) // 4


def http_error(status: int, message: str = "internal error", **extra: Any) -> dict[str, Any]:
    """An error reply; `extra` joins the error object (e.g. llama.cpp's type and n_ctx on an overflow)."""
    return {"status": status, "error": message, "extra": extra}


def slow(seconds: float, step: Step) -> dict[str, Any]:
    return {"sleep": seconds, "then": step}


class OpenAIStub:
    """The scripted server; use as a context manager (starts and stops it)."""

    def __init__(self, script: list[Step], *, after: Step | None = None,
                 routes: dict[str, Any] | None = None) -> None:
        self.script = list(script)
        self.after = after
        self.routes = dict(routes or {})
        self.requests: list[dict[str, Any]] = []  # chat requests: {"path", "headers", "body", "step", ...}
        self.probes: list[dict[str, Any]] = []  # any other request: {"method", "path", "body"}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="openai-stub", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> OpenAIStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def messages(self, i: int) -> list[dict[str, Any]]:
        """The messages of the i-th request."""
        return self.requests[i]["body"]["messages"]

    def next_step(self, body: dict[str, Any]) -> tuple[int, Step]:
        with self.lock:
            n = len(self.requests) - 1
            if self.script:
                step = self.script.pop(0)
            elif self.after is not None:
                step = self.after
            else:
                step = http_error(400, "the stub's script has run out")
        while callable(step):
            step = step(body)
        return n, step

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._route("GET", None)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except json.JSONDecodeError:
                    body = {"unparsed": raw.decode(errors="replace")}
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    return self._route("POST", body)
                record = {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                          "body": body, "arrived_at": time.monotonic(), "closed_at": None}
                with stub.lock:
                    stub.requests.append(record)
                n, step = stub.next_step(body)
                record["step"] = step
                while "sleep" in step:
                    if self._wait_or_closed(step["sleep"]):
                        record["closed_at"] = time.monotonic()
                        return
                    step = step["then"]
                    while callable(step):
                        step = step(body)
                if "status" in step:
                    return self._send(step["status"], {"error": {"message": step["error"], "type": "server_error",
                                                                 **step.get("extra", {})}})
                tokens = step.get("tokens")
                if tokens is None:  # about what a tokenizer would count for the prompt
                    tokens = prompt_tokens(body) + 10
                usage = {"prompt_tokens": tokens - 10, "completion_tokens": 10, "total_tokens": tokens}
                if body.get("stream"):
                    return self._stream(n, body, step, usage)
                self._send(200, {
                    "id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", "stub"),
                    "choices": [{"index": 0, "message": step["reply"], "finish_reason": step["finish_reason"]}],
                    "usage": usage})

            def _route(self, method: str, body: Any) -> None:
                path = self.path.split("?")[0]
                with stub.lock:
                    stub.probes.append({"method": method, "path": path, "body": body})
                if path in stub.routes:
                    return self._send(200, stub.routes[path])
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found_error"}})

            def _wait_or_closed(self, seconds: float) -> bool:
                """Sleep `seconds`, or less when the client closes the connection (then True)."""
                end = time.monotonic() + seconds
                while (left := end - time.monotonic()) > 0:
                    ready, _, _ = select.select([self.connection], [], [], min(left, 0.02))
                    if ready:
                        try:
                            if not self.connection.recv(1, socket.MSG_PEEK):  # b"": the client is gone
                                return True
                        except OSError:
                            return True
                        time.sleep(min(left, 0.02))
                return False

            def _stream(self, n: int, body: dict[str, Any], step: dict[str, Any], usage: dict[str, Any]) -> None:
                base = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": int(time.time()),
                        "model": body.get("model", "stub")}
                reply = step["reply"]
                deltas: list[dict[str, Any]] = [{"role": "assistant", "content": None}]
                text = reply.get("content") or ""
                deltas += [{"content": text[i:i + 7]} for i in range(0, len(text), 7)]
                for k, tc in enumerate(reply.get("tool_calls") or []):
                    args = tc["function"]["arguments"]
                    deltas.append({"tool_calls": [{"index": k, "id": tc["id"], "type": "function",
                                                   "function": {"name": tc["function"]["name"], "arguments": ""}}]})
                    deltas += [{"tool_calls": [{"index": k, "function": {"arguments": args[i:i + 9]}}]}
                               for i in range(0, len(args), 9)]
                events = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
                events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": step["finish_reason"]}]})
                events.append({**base, "choices": [], "usage": usage})
                data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout): nobody reads this reply

        return Handler
