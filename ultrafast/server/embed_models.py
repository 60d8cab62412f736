"""Which served models are embedding models, and the server state when only those are served.

A model is an embedding model when its GGUF declares a pooling type (BERT-style encoders
converted with their sentence-transformers pooling). `--models chat=a.gguf,emb=minilm.gguf`
serves the chat model(s) as before (the first chat model is the default) and each embedding
model on its own EmbeddingEngine, loaded at start and kept (they are small, and the residency
cache's budget is sized in KV slots, which encoders do not have). `--model minilm.gguf`
alone serves embeddings only: the chat routes answer 400 naming the model
(state.check_generates). The engine builders come from serve.py (the import boundary).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ultrafast.config import EngineConfig, ServerConfig
from ultrafast.server.admission import Admission
from ultrafast.server.errors import APIError
from ultrafast.server.metrics import ServerMetrics
from ultrafast.server.protocol import Limits
from ultrafast.server.runtime import ModelRuntime, ModelSet
from ultrafast.server.state import ServerState
from ultrafast.server.tenants import ApiKeys

Models = tuple[tuple[str, str], ...]


def split_embedding_models(
    engine_config: EngineConfig, config: ServerConfig, pooling_of: Callable[[str], str | None]
) -> tuple[Models, EngineConfig | None, ServerConfig]:
    """(the embedding models, the chat engine config or None when there is no chat model,
    the server config with only the chat models in `models`)."""
    models = config.models or ((_name_of(config, engine_config.model), engine_config.model),)
    embed = tuple((name, path) for name, path in models if pooling_of(path) is not None)
    if not embed:
        return (), engine_config, config
    chat = tuple(m for m in models if m not in embed)
    if not chat:
        return embed, None, replace(config, models=(), served_model_name=embed[0][0])
    name, path = chat[0]
    config = replace(
        config,
        models=chat if len(chat) > 1 else (),
        served_model_name=name,
        pinned_models=tuple(p for p in config.pinned_models if p in dict(chat)),
    )
    return embed, replace(engine_config, model=path), config


def _name_of(config: ServerConfig, path: str) -> str:
    return config.served_model_name or Path(path).name.removesuffix(".gguf")


class EmbeddingTokenizer:
    """The tokenizer an embedding-only server shows /tokenize (the model's own WordPiece)."""

    chat_template = None
    special_tokens: dict = {}
    generation_defaults: dict = {}

    def __init__(self, engine: Any):
        self.engine = engine
        self.vocab_size = engine.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.executor.tokenize(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        raise APIError(
            400, "this server serves an embedding model: it does not detokenize", code="unsupported"
        )


def embedding_only_state(
    config: ServerConfig, embedders: dict[str, Any], api_keys: ApiKeys | None
) -> ServerState:
    """The state of a server with no chat model: the default runtime's engine is the first
    embedding engine (its read API matches EngineThread's, so /ready and the engine watch
    work unchanged)."""
    name, engine = next(iter(embedders.items()))
    runtime = ModelRuntime(
        name,
        tokenizer=EmbeddingTokenizer(engine),  # type: ignore[arg-type]
        max_model_len=engine.max_input_tokens,
        limits=Limits(vocab_size=engine.vocab_size, max_tokens_cap=config.max_tokens_cap),
        admission=Admission(config),
        engine=engine,
    )
    return ServerState(
        config=config,
        models=ModelSet([runtime]),
        metrics=ServerMetrics(tenants=api_keys.tenants if api_keys else ()),
        api_keys=api_keys,
        embedders=embedders,
    )
