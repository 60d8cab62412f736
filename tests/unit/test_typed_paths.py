"""Checks that replaced silent None paths (found by mypy) with explicit ones."""

import pytest

from ultrafast.llm import _prompt_batch
from ultrafast.request import Request, SamplingParams


def test_held_slot_id_is_the_slot_of_a_placed_request():
    request = Request("r", [1, 2, 3], SamplingParams())
    with pytest.raises(RuntimeError, match="holds no KV slot"):
        _ = request.held_slot_id
    request.slot_id = 0  # slot 0 is a slot, not "none"
    assert request.held_slot_id == 0
    request.slot_id = 5
    assert request.held_slot_id == 5


@pytest.mark.parametrize(
    ("prompts", "batch"),
    [
        ("hello", ["hello"]),
        ([4, 5, 6], [[4, 5, 6]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
        ([], []),
    ],
)
def test_generate_takes_one_prompt_or_a_list_of_them(prompts, batch):
    assert _prompt_batch(prompts) == batch


def test_a_bare_token_id_inside_a_list_of_prompts_is_refused():
    with pytest.raises(TypeError, match="not bare ids"):
        _prompt_batch(["a", 7])  # type: ignore[list-item]
