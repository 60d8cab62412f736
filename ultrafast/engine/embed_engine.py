"""The embedding engine: its own thread, an inbox, and EmbedQueue's passes over one executor.

Embedding requests are prefill-only: a pass embeds the waiting inputs of every request at
once (core/embed_queue.py packs them, priority tier first), so concurrent requests are
batched into one forward pass. A job's callback runs on this thread when its last input is
done; the server turns it into an asyncio result (server/bridge.py). The read API matches
EngineThread's (`alive`, `dead_reason`, `snapshot()`), so a server that serves only an
embedding model can watch and report it like a chat engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from ultrafast.core.embed_queue import EmbedError, EmbedJob, EmbedPiece, EmbedQueue
from ultrafast.engine.read_api import EngineSnapshot

log = logging.getLogger(__name__)


class EmbeddingEngine:
    def __init__(self, executor: Any, max_waiting_inputs: int = 65536):
        self.executor = executor
        self.queue = EmbedQueue(
            executor.max_batch_tokens,
            executor.max_seqs,
            max_waiting_inputs,
            pass_tokens=getattr(executor, "pass_tokens", None),
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._dead_reason: str | None = None
        self._stopping = False
        self.passes = 0
        self.inputs_done = 0
        self._snapshot = self._make_snapshot()
        self._thread = threading.Thread(target=self._run, name="ultrafast-embed", daemon=True)
        self._thread.start()

    # ---- what the server calls (any thread) -------------------------------------------------

    @property
    def pooling(self) -> str:
        return self.executor.pooling

    @property
    def gguf_path(self) -> str:
        return self.executor.gguf_path

    @property
    def dimensions(self) -> int:
        return self.executor.n_embd

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    @property
    def max_input_tokens(self) -> int:
        return self.executor.max_input_tokens

    def tokenize(self, text: str) -> list[int]:
        return self.executor.tokenize(text)

    def sep_token(self) -> int:
        return self.executor.sep_token()

    def submit(self, job: EmbedJob) -> None:
        if self._dead_reason is not None:
            job.on_done(None, EmbedError("engine_error", "the embedding engine is not running"))
            return
        self._inbox.put(job)

    def cancel(self, job: EmbedJob) -> None:
        job.cancelled = True  # its unscheduled inputs are skipped; no callback follows

    @property
    def alive(self) -> bool:
        return self._dead_reason is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.executor.close()

    # ---- the engine thread --------------------------------------------------------------------

    def _make_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            step_id=self.passes - 1,
            num_waiting_by_tier=self.queue.waiting_by_tier(),
            max_model_len=self.executor.max_input_tokens,
            max_num_seqs=self.executor.max_seqs,
            max_waiting=self.queue.max_waiting_inputs,
        )

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._take_inbox(block=not self.queue.has_work())
                pieces = self.queue.next_batch()
                if pieces:
                    self._pass(pieces)
                self._snapshot = self._make_snapshot()
        except BaseException as exc:  # a dead engine fails every waiting job, then says why
            self._dead_reason = f"{type(exc).__name__}: {exc}"
            log.exception("the embedding engine died")
            self._fail_everything()

    def _take_inbox(self, block: bool) -> None:
        item = self._inbox.get() if block else self._next_nowait()
        while item is not None:
            refused = self.queue.add(item)
            if refused is not None:
                item.on_done(None, refused)
            item = self._next_nowait()

    def _next_nowait(self) -> EmbedJob | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _pass(self, pieces: list[EmbedPiece]) -> None:
        try:
            vectors = self.executor.embed([p.job.inputs[p.index] for p in pieces])
        except (RuntimeError, ValueError) as exc:  # this pass's jobs fail; the engine goes on
            for job in {id(p.job): p.job for p in pieces}.values():
                self._fail(job, EmbedError("engine_error", f"the embedding pass failed: {exc}"))
            return
        self.passes += 1
        self.inputs_done += len(pieces)
        for row, piece in enumerate(pieces):
            job = piece.job
            if job.failed:
                continue
            job.results[piece.index] = vectors[row]
            job.num_done += 1
            if job.num_done == len(job.inputs) and not job.cancelled:
                job.on_done(job.results, None)

    def _fail(self, job: EmbedJob, error: EmbedError) -> None:
        if not job.failed:
            job.failed = True
            job.cancelled = True  # its remaining inputs are dropped by the queue
            job.on_done(None, error)

    def _fail_everything(self) -> None:
        reason = EmbedError("engine_error", "the embedding engine stopped")
        for tier_queue in self.queue.waiting.values():
            for waiting in tier_queue:
                self._fail(waiting, reason)
            tier_queue.clear()
        while (arrived := self._next_nowait()) is not None:
            self._fail(arrived, reason)
