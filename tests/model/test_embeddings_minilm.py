"""all-MiniLM-L6-v2 converted to GGUF and run by llama.cpp in embedding mode, against a PyTorch
reference of the same weights (transformers' BertModel + mean pooling + L2 normalisation):
cosine >= 0.999 on 200 varied sentences, the same retrieval order, the pooling the GGUF
declares, batching that changes nothing. On every embedding path (executors/embed_choice.py:
llama.cpp, PyTorch f32 and bf16), since the server picks the one it measures fastest."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.embed_model import minilm, varied_sentences
from ultrafast.executors.embed_choice import PATHS, open_embedding_executor
from ultrafast.executors.ggml_embed import EmbeddingExecutor, gguf_pooling

transformers = pytest.importorskip("transformers", reason="the reference needs transformers")


@pytest.fixture(scope="module")
def files():
    return minilm()


@pytest.fixture(scope="module", params=PATHS)
def executor(files, request):
    ex = open_embedding_executor(str(files[1]), n_threads=2, path=request.param)
    assert ex.path_name == request.param
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def reference(files):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(files[0]))
    model = transformers.BertModel.from_pretrained(str(files[0])).eval()

    def embed(texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            batch = tokenizer(
                texts, padding=True, truncation=True, max_length=512, return_tensors="pt"
            )
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            return torch.nn.functional.normalize(pooled, dim=-1).numpy()

    return embed


def ours(executor, texts: list[str], batch: int = 32) -> np.ndarray:
    rows = []
    for i in range(0, len(texts), batch):
        rows.append(executor.embed([executor.tokenize(t) for t in texts[i : i + batch]]))
    return np.concatenate(rows)


def test_gguf_declares_mean_pooling_and_the_model_shape(files, executor):
    assert gguf_pooling(str(files[1])) == "mean"
    assert executor.pooling == "mean" and executor.architecture == "bert"
    assert executor.n_embd == 384 and executor.max_input_tokens == 512


def test_cosine_parity_with_pytorch_on_200_sentences(executor, reference):
    texts = varied_sentences(200)
    assert len(set(texts)) == 200
    got, want = ours(executor, texts), reference(texts)
    cosine = (got * want).sum(axis=1)
    worst = int(np.argmin(cosine))
    assert cosine.min() >= 0.999, f"cosine {cosine.min():.5f} on {texts[worst]!r}"
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_retrieval_order_matches_pytorch(executor, reference):
    passages = [
        "The Eiffel Tower is in Paris and was finished in 1889.",
        "Photosynthesis turns light, water and carbon dioxide into sugar.",
        "Python lists are dynamic arrays; appending is amortised O(1).",
        "The Great Barrier Reef lies off the coast of Queensland, Australia.",
        "A sourdough starter is a culture of flour, water, yeast and bacteria.",
        "TCP retransmits segments that are not acknowledged in time.",
        "Mount Everest is the highest mountain above sea level.",
        "Espresso is brewed by forcing hot water through finely ground coffee.",
    ]
    queries = [
        "Which landmark is in France?",
        "how do plants make food",
        "What happens when a network packet is lost?",
        "bread baking with wild yeast",
        "tallest peak on earth",
        "coffee brewing methods",
    ]
    got_q, got_p = ours(executor, queries), ours(executor, passages)
    want_q, want_p = reference(queries), reference(passages)
    got_rank = np.argsort(-(got_q @ got_p.T), axis=1)
    want_rank = np.argsort(-(want_q @ want_p.T), axis=1)
    np.testing.assert_array_equal(got_rank, want_rank)
    assert list(got_rank[:, 0]) == [0, 1, 5, 4, 6, 7]  # and the answers are the right ones


def test_a_sentence_embeds_the_same_alone_and_in_a_batch(executor):
    texts = varied_sentences(40)
    alone = executor.embed([executor.tokenize(texts[7])])[0]
    batched = ours(executor, texts, batch=40)[7]
    assert float(alone @ batched) >= 0.99999


def test_a_chat_gguf_has_no_embedding_mode(tmp_path):
    from ultrafast.config import smollm2_gguf
    from ultrafast.executors.ggml_embed import NoEmbeddingMode

    chat = smollm2_gguf()
    if not chat.is_file():
        pytest.skip(f"SmolLM2 is not at {chat} (`make setup` fetches it)")
    assert gguf_pooling(str(chat)) is None
    with pytest.raises(NoEmbeddingMode, match="no embedding mode"):
        EmbeddingExecutor(str(chat))


def test_auto_measures_and_keeps_one_path_saying_which(files, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="ultrafast.executors.embed_choice"):
        ex = open_embedding_executor(str(files[1]), n_threads=1, path="auto")
    try:
        assert ex.path_name in PATHS
        lines = [r.getMessage() for r in caplog.records if "embedding passes" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith(f"embedding passes: {ex.path_name} (")
        assert all(f"{name} " in lines[0] for name in PATHS)  # every path was timed
    finally:
        ex.close()
