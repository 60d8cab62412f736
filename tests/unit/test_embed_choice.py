"""The embedding path chosen at start (executors/embed_choice.py): the measured fastest wins,
llama.cpp keeps ties, bf16 is left out when it changes the vectors, the calibration splits
a batch as the scheduler does; and the PyTorch pass's length groups and poolings."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.unit.fake_embedder import FakeEmbedExecutor
from ultrafast.core.embed_queue import EmbedJob, EmbedQueue
from ultrafast.executors import embed_choice
from ultrafast.executors.torch_embed import length_groups, pool


class Path(FakeEmbedExecutor):
    def __init__(self, name: str, seconds: float, skew: float = 0.0):
        super().__init__(vocab_size=30000, max_seqs=64)
        self.path_name, self.seconds, self.skew = name, seconds, skew
        self.pass_tokens, self.n_threads = 256, 2
        self.max_batch_tokens = 1024

    def embed(self, inputs):
        out = super().embed(inputs)
        if self.skew:  # vectors that drift from the reference (a lossy dtype)
            out = out + self.skew * np.roll(out, 1, axis=1)
            out /= np.linalg.norm(out, axis=1, keepdims=True)
        return out


@pytest.fixture
def timed(monkeypatch):
    """Each path's calibration CPU time is its `seconds`, its wall time 1 s: CPU time decides
    (no clock in the test)."""
    monkeypatch.setattr(
        embed_choice, "_time_batch", lambda executor, inputs: (executor.seconds, 1.0)
    )


def test_the_fastest_path_wins_and_one_line_says_so(timed, caplog):
    ggml = Path("ggml", 0.30)
    paths = {"torch-f32": Path("torch-f32", 0.20), "torch-bf16": Path("torch-bf16", 0.08)}
    with caplog.at_level(logging.INFO, logger=embed_choice.__name__):
        chosen = embed_choice.choose(ggml, paths)
    assert chosen is paths["torch-bf16"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("embedding passes: torch-bf16")
    assert "ggml 300 ms CPU / 1000 ms" in lines[0] and "torch-bf16 80 ms CPU" in lines[0]


def test_ggml_stays_where_torch_is_not_clearly_faster(timed):
    ggml = Path("ggml", 0.100)
    paths = {"torch-f32": Path("torch-f32", 0.120), "torch-bf16": Path("torch-bf16", 0.095)}
    assert embed_choice.choose(ggml, paths) is ggml


def test_bf16_is_left_out_when_its_vectors_drift(timed, caplog):
    ggml = Path("ggml", 0.30)
    paths = {"torch-f32": Path("torch-f32", 0.20), "torch-bf16": Path("torch-bf16", 0.01, 0.2)}
    with caplog.at_level(logging.INFO, logger=embed_choice.__name__):
        assert embed_choice.choose(ggml, paths) is paths["torch-f32"]
    assert "bf16 left out: cosine" in caplog.records[0].getMessage()


def test_calibration_passes_are_the_schedulers_passes():
    lengths = [30, 200, 5, 120, 64, 64, 64, 1, 250, 7]
    inputs = [list(range(1, n + 1)) for n in lengths]
    queue = EmbedQueue(max_batch_tokens=512, max_seqs=4, max_waiting_inputs=100, pass_tokens=256)
    queue.add(EmbedJob(inputs))
    want = []
    while pieces := queue.next_batch():
        want.append([inputs[p.index] for p in pieces])
    assert embed_choice.passes(inputs, 256, 4) == want


def test_a_forced_path_is_checked(monkeypatch):
    monkeypatch.setenv("ULTRAFAST_EMBED_PATH", "torch-f16")
    closed = []

    class Stub(Path):
        def __init__(self, *args, **kwargs):
            super().__init__("ggml", 0.1)

        def close(self):
            closed.append(True)

    monkeypatch.setattr(embed_choice, "EmbeddingExecutor", Stub)
    with pytest.raises(ValueError, match="ULTRAFAST_EMBED_PATH='torch-f16'"):
        embed_choice.open_embedding_executor("x.gguf")
    assert closed == [True]
    monkeypatch.setenv("ULTRAFAST_EMBED_PATH", "ggml")
    assert embed_choice.open_embedding_executor("x.gguf").path_name == "ggml"


def test_length_groups_bound_the_padding():
    lengths = [3, 40, 4, 5, 38, 3, 100, 6]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        padded = len(group) * max(lengths[i] for i in group)
        assert padded <= 1.5 * sum(lengths[i] for i in group)
    assert [6] in groups  # the long one pads nobody
    assert len(groups) < len(lengths)  # and similar lengths share a group


def test_poolings_read_only_each_inputs_own_tokens():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    lengths = torch.tensor([3, 1])
    mask = torch.arange(3)[None, :] < lengths[:, None]
    assert pool(hidden, mask, lengths, "mean").tolist() == [[2.0, 3.0], [6.0, 7.0]]
    assert pool(hidden, mask, lengths, "cls").tolist() == [[0.0, 1.0], [6.0, 7.0]]
    assert pool(hidden, mask, lengths, "last").tolist() == [[4.0, 5.0], [6.0, 7.0]]
