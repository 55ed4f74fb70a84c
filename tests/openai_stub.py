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
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_ids = itertools.count(1)

Step = dict[str, Any] | Callable[[dict[str, Any]], Any]


def call(name: str, /, *, raw_arguments: str | None = None, tokens: int = 100, **arguments: Any) -> dict[str, Any]:
    """A reply with one tool call; raw_arguments sends the arguments string as is (e.g. broken JSON)."""
    return calls([(name, raw_arguments if raw_arguments is not None else json.dumps(arguments))], tokens=tokens)


def calls(items: list[tuple[str, str]], *, tokens: int = 100) -> dict[str, Any]:
    """A reply with several tool calls, each (name, arguments as a JSON string)."""
    tool_calls = [{"id": f"call_{next(_ids)}", "type": "function", "function": {"name": n, "arguments": a}}
                  for n, a in items]
    return {"reply": {"role": "assistant", "content": None, "tool_calls": tool_calls},
            "finish_reason": "tool_calls", "tokens": tokens}


def say(text: str, *, tokens: int = 100) -> dict[str, Any]:
    """A final (plain text) reply with no tool call."""
    return {"reply": {"role": "assistant", "content": text}, "finish_reason": "stop", "tokens": tokens}


def http_error(status: int, message: str = "internal error") -> dict[str, Any]:
    return {"status": status, "error": message}


def slow(seconds: float, step: Step) -> dict[str, Any]:
    return {"sleep": seconds, "then": step}


class OpenAIStub:
    """The scripted server; use as a context manager (starts and stops it)."""

    def __init__(self, script: list[Step], *, after: Step | None = None) -> None:
        self.script = list(script)
        self.after = after
        self.requests: list[dict[str, Any]] = []  # {"path", "headers", "body", "step"} in arrival order
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
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except json.JSONDecodeError:
                    body = {"unparsed": raw.decode(errors="replace")}
                with stub.lock:
                    stub.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                          "body": body})
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                n, step = stub.next_step(body)
                stub.requests[n]["step"] = step
                while "sleep" in step:
                    time.sleep(step["sleep"])
                    step = step["then"]
                    while callable(step):
                        step = step(body)
                if "status" in step:
                    return self._send(step["status"], {"error": {"message": step["error"], "type": "server_error"}})
                tokens = step.get("tokens", 100)
                self._send(200, {
                    "id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", "stub"),
                    "choices": [{"index": 0, "message": step["reply"], "finish_reason": step["finish_reason"]}],
                    "usage": {"prompt_tokens": tokens - 10, "completion_tokens": 10, "total_tokens": tokens}})

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
