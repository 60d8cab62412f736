"""The grammar runtime built after the server is ready, not before its first answer.

Building the llguidance tokenizer and the first-byte table takes ~0.3 s for the default model
(49k tokens), all of it Python holding the GIL, and a plain chat answer needs none of it. A
`DeferredGrammarRuntime` stands in for `GrammarRuntime` from the start; the engine builds it
on its own thread the first time it is idle (GrammarStage.build_when_idle: after the first
answer when a request comes at once, never beside the start costs' timings). Whatever needs
it before that waits for it: a constrained request that arrives first compiles on the
compile pool once it is built (its prompt prefills meanwhile, as for any compile), so it
waits and succeeds; it never fails for being early. Where llguidance cannot use the
vocabulary the build fails as `GrammarRuntime.for_tokenizer` would, and each constrained
request is then refused with GrammarUnavailable (a 400 `unsupported_parameter`), as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

from ultrafast.grammar.cache import GrammarError
from ultrafast.grammar.matcher import GrammarMatcher, GrammarRuntime
from ultrafast.grammar.spec import GrammarSpec
from ultrafast.grammar.tokenizer import GrammarUnavailable

log = logging.getLogger("ultrafast")


class DeferredGrammarRuntime:
    """`GrammarRuntime`'s interface over one built on first use or by `start()`."""

    def __init__(self, build: Callable[[], GrammarRuntime]):
        self._build = build
        self._runtime: GrammarRuntime | None = None
        self._error: GrammarUnavailable | None = None
        self._lock = threading.Lock()  # one build, whoever asks first
        self._waiting = 0  # compiles waiting for the build
        self._count_lock = threading.Lock()

    @property
    def built(self) -> bool:
        return self._runtime is not None or self._error is not None

    @property
    def started(self) -> bool:
        """Built, or being built (by `start`, `build_quietly` or a first use)."""
        return self.built or self._lock.locked()

    def start(self) -> None:
        """Build on a thread of its own now (no-op once built)."""
        if not self.built:
            threading.Thread(target=self.build_quietly, name="grammar-build", daemon=True).start()

    def build_quietly(self) -> None:
        """Build now on this thread (or wait for the build under way); a failure is logged
        once and refuses each constrained request."""
        try:
            self.get()
        except GrammarUnavailable:
            pass

    def get(self) -> GrammarRuntime:
        """The runtime (built now if need be); GrammarUnavailable if llguidance cannot use
        this vocabulary."""
        with self._lock:
            if not self.built:
                try:
                    self._runtime = self._build()
                except GrammarUnavailable as exc:
                    log.warning("constrained decoding is off: %s", exc)
                    self._error = exc
        if self._runtime is None:
            assert self._error is not None
            raise self._error
        return self._runtime

    @property
    def compiles_running(self) -> int:
        runtime = self._runtime
        return self._waiting + (runtime.compiles_running if runtime is not None else 0)

    @property
    def vocab_size(self) -> int:
        return self.get().vocab_size

    @property
    def max_token_bytes(self) -> int | None:
        """None where the build failed (the compile then refuses the request). Before the
        build ends this waits for it: on the event loop, once, for a constrained request
        that came within the build's ~0.3 s after ready."""
        try:
            return self.get().max_token_bytes
        except GrammarUnavailable:
            return None

    @property
    def lltokenizer(self):
        return self.get().lltokenizer

    @property
    def cache(self):
        return self.get().cache

    def compile(self, spec: GrammarSpec) -> None:
        self.get().compile(spec)

    def start_compile(self, spec: GrammarSpec, pool: Executor) -> Future:
        """As `GrammarRuntime.start_compile`; before the build, the compile waits for it on
        `pool` (never on the caller's thread)."""
        if self._runtime is not None:
            return self._runtime.start_compile(spec, pool)
        with self._count_lock:  # counted here (the event loop), uncounted on the pool
            self._waiting += 1
        self.start()
        return pool.submit(self._compile_after_build, spec)

    def _compile_after_build(self, spec: GrammarSpec) -> None:
        try:
            runtime = self.get()
        finally:
            with self._count_lock:
                self._waiting -= 1
        runtime.compile(spec)

    def matcher(self, spec: GrammarSpec, request_eos_ids: tuple[int, ...]) -> GrammarMatcher:
        """A ValueError (as a failed compile) where the build failed: the engine drops that
        request alone; the server answers it from the compile's own error."""
        try:
            runtime = self.get()
        except GrammarUnavailable as exc:
            raise GrammarError(str(exc)) from None
        return runtime.matcher(spec, request_eos_ids)
