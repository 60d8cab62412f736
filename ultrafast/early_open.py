"""`serve`'s head start: the model's files are resolved, its config sized and its llama.cpp
model and context opened on a thread of their own, from the moment the port is bound, while
the model-load thread imports the server app, the engine and torch.

The llama.cpp calls run in C with the GIL released, so on a 2-core machine they take the
second core while the imports hold the first (the default model: ~0.6 s of model load and KV
clearing off the path to the first answer). Nothing here is a second way to build an engine:
`llm.build_engine` takes the sized config from `sized_for` when it is asked for the same
config, and `GgmlExecutor` adopts the open only when its parameters are exactly the ones it
would have opened with (executors/ggml_open.py); anything else is closed and done as always.
A failure here is silent: the engine does the same step again and reports it in its place.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from ultrafast.config import EngineConfig

if TYPE_CHECKING:
    from ultrafast.model_files import ModelFiles

log = logging.getLogger("ultrafast")


class _HeadStart:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.sized: tuple[EngineConfig, ModelFiles] | None = None
        self.ready = threading.Event()  # set once sized (or given up)
        self.taken = False  # its sizing went to an engine
        self.thread = threading.Thread(target=self._run, name="llama-open", daemon=True)

    def _run(self) -> None:
        early = None
        try:
            from ultrafast.engine_sizing import embedding_pooling, executor_kind, sized

            if embedding_pooling(self.config.model) is not None:  # served by another engine
                return
            self.sized = sized(self.config)
            if executor_kind(self.config) == "ggml" and self.sized[1].gguf_path is not None:
                early = _register_open(*self.sized)
        except Exception as exc:  # the engine sizes again and reports it
            log.debug("early open skipped: %s", exc)
        finally:
            self.ready.set()
        if early is not None:
            early.run()


def _register_open(config: EngineConfig, files: ModelFiles):
    from ultrafast.engine_sizing import ggml_executor_args
    from ultrafast.executors import ggml_open

    gguf_path, args = ggml_executor_args(config, files)
    params = ggml_open.OpenParams.of(
        gguf_path,
        args["num_slots"],
        args["max_model_len"],
        args["n_threads"],
        args["n_threads_batch"],
        args["max_num_batched_tokens"],
        flash_attn=args["flash_attn"],
        weights_path=args["weights_path"],
    )
    return ggml_open.register_early(params)


_head_start: _HeadStart | None = None


def start(config: EngineConfig) -> None:
    """Begin sizing `config` and opening its model now, on a thread of their own."""
    global _head_start
    _head_start = _HeadStart(config)
    _head_start.thread.start()


def sized_for(config: EngineConfig) -> tuple[EngineConfig, ModelFiles] | None:
    """The sized config and files when the head start was given `config` (waiting for it;
    the first engine built only), else None."""
    head = _head_start
    if head is None or head.taken or head.config != config:
        return None
    head.taken = True
    head.ready.wait()
    return head.sized


def discard() -> None:
    """After the engine is built: close whatever the head start opened that was not used."""
    global _head_start
    head, _head_start = _head_start, None
    if head is None:
        return
    head.ready.wait()  # an open it registers after this would stay open
    from ultrafast.executors import ggml_open

    ggml_open.discard_early()
