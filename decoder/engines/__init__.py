"""Engines users already run, behind one interface: start, generate (timed from outside), score positions.

The bench (decoder/lab/bench.py, `--peers`) and later the harness drive an engine only through `Engine`;
`decoder/engines/llamacpp.py` is the llama.cpp server, and its docstring says what another
OpenAI-compatible server (vLLM, SGLang) needs to plug in the same way.

Token ids in, token ids out: the engine never tokenizes for us, so its output is compared with ours
token for token. Greedy only (temperature 0). A margin is the engine's top-1 minus top-2 logit at a
position, which the near-tie rule (decoder/contract.py) needs at a mismatch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType


class EngineError(RuntimeError):
    """An engine failed to start, answer or stop; the message is one line (and names the engine's log)."""


class EngineNotBuilt(EngineError):
    """The engine's binaries are not in the cache; the message says how to build them."""


@dataclass(frozen=True)
class Completion:
    """A greedy continuation: the new tokens (an end-of-sequence token included, as ours), the wall time
    around the request as the client saw it (prompt prefill and transport included), and the drafted and
    accepted token counts where the engine reports them (0 without speculation)."""

    tokens: list[int]
    seconds: float
    drafted: int = 0
    accepted: int = 0
    timings: dict = field(default_factory=dict)  # the engine's own account of its phases, where it gives one


@dataclass(frozen=True)
class Score:
    """The engine's greedy token after a context and its top-2 logit margin (None: the engine gave none)."""

    token: int
    margin: float | None


class Engine(ABC):
    """One running engine configuration (model, speculative flags, threads). Use as a context manager: the
    process is stopped on exit, exceptions included."""

    name: str

    @abstractmethod
    def start(self) -> None:
        """Start the engine and return when it answers requests (an EngineError if it cannot)."""

    @abstractmethod
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> Completion:
        """Greedy decoding from token ids: at most `max_new_tokens` new tokens, stopping after end of sequence."""

    @abstractmethod
    def score(self, context: Sequence[int], continuation: Sequence[int] = ()) -> list[Score]:
        """Score positions: the greedy token and top-2 margin after `context + continuation[:i]` for every i in
        0..len(continuation) (token forcing puts stock's token in place and reads on)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the engine and every process it started; safe to call twice."""

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
