"""server/embed_models.split_embedding_models: which served models are embedding models, and
the chat configuration left (the first chat model is the default; None when there is none)."""

from ultrafast.config import EngineConfig, ServerConfig
from ultrafast.server.embed_models import split_embedding_models


def pooling_of(path: str) -> str | None:
    return "mean" if "minilm" in path else None


def test_a_lone_chat_model_is_untouched():
    engine, config = EngineConfig(model="/m/chat.gguf"), ServerConfig()
    embed, chat, cfg = split_embedding_models(engine, config, pooling_of)
    assert embed == () and chat is engine and cfg is config


def test_a_lone_embedding_model_serves_embeddings_only_under_its_name():
    embed, chat, cfg = split_embedding_models(
        EngineConfig(model="/m/all-minilm.f32.gguf"), ServerConfig(), pooling_of
    )
    assert embed == (("all-minilm.f32", "/m/all-minilm.f32.gguf"),) and chat is None
    assert cfg.served_model_name == "all-minilm.f32"
    named = ServerConfig(served_model_name="mini")
    embed, _, _ = split_embedding_models(EngineConfig(model="/m/minilm.gguf"), named, pooling_of)
    assert embed == (("mini", "/m/minilm.gguf"),)


def test_models_listed_embedding_first_still_default_to_the_first_chat_model():
    models = (("emb", "/m/minilm.gguf"), ("chat", "/m/chat.gguf"))
    config = ServerConfig(models=models, pinned_models=("emb", "chat"))
    embed, chat, cfg = split_embedding_models(
        EngineConfig(model="/m/minilm.gguf"), config, pooling_of
    )
    assert embed == (("emb", "/m/minilm.gguf"),)
    assert chat is not None and chat.model == "/m/chat.gguf"
    assert cfg.served_model_name == "chat" and cfg.models == () and cfg.pinned_models == ("chat",)


def test_two_chat_models_keep_residency():
    models = (("a", "/m/a.gguf"), ("emb", "/m/minilm.gguf"), ("b", "/m/b.gguf"))
    embed, chat, cfg = split_embedding_models(
        EngineConfig(model="/m/a.gguf"), ServerConfig(models=models), pooling_of
    )
    assert [name for name, _ in embed] == ["emb"]
    assert cfg.models == (("a", "/m/a.gguf"), ("b", "/m/b.gguf")) and chat.model == "/m/a.gguf"
