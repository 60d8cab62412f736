"""Legacy completions logprobs: echoed prompt entries first, text_offset counted from the start
of the choice's text and carried across stream chunks, logprobs 0 entries."""

import orjson

from ultrafast.core.types import TokenLogprobs
from ultrafast.server.openai_format import ChoiceState, ChunkWriter, completion_response

PIECES = {1: "def", 2: " f", 3: "(x", 4: "):", 5: "\n", 6: "  ", 7: " return"}


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def lp(token, value, top=()):
    return TokenLogprobs(token, value, list(top))


def test_echo_lists_the_prompt_first_with_offsets_from_the_echoed_text():
    choice = ChoiceState(
        0,
        text="def f(x):" + "\n  ",
        prompt_token_ids=[1, 2, 3, 4],
        prompt_logprobs=[
            None,
            lp(2, -1.0, [(3, -0.5)]),
            lp(3, -2.0, [(3, -2.0)]),
            lp(4, -0.1, [(4, -0.1)]),
        ],
        echo_chars=len("def f(x):"),
    )
    choice.logprobs = [lp(5, -0.3, [(5, -0.3)]), lp(6, -0.7, [(7, -0.2)])]
    body = completion_response("cmpl-1", "m", "default", [choice], {}, decode, True)
    out = body["choices"][0]["logprobs"]
    assert out["tokens"] == ["def", " f", "(x", "):", "\n", "  "]
    assert out["token_logprobs"] == [None, -1.0, -2.0, -0.1, -0.3, -0.7]
    assert out["top_logprobs"][0] is None and out["top_logprobs"][1] == {"(x": -0.5}
    assert out["text_offset"] == [0, 3, 5, 7, 9, 10]
    text = body["choices"][0]["text"]
    assert all(text[o : o + len(t)] == t for t, o in zip(out["tokens"], out["text_offset"]))


def test_logprobs_0_entries_hold_the_token_itself():
    choice = ChoiceState(0, text=" f(x", logprobs=[lp(2, -1.5), lp(3, -0.25)])
    out = completion_response("c", "m", "default", [choice], {}, decode, True)
    assert out["choices"][0]["logprobs"]["top_logprobs"] == [{" f": -1.5}, {"(x": -0.25}]


def events(chunks):
    return [orjson.loads(c[len(b"data: ") :]) for c in chunks]


def test_streamed_offsets_accumulate_per_choice_and_start_after_the_echo():
    writer = ChunkWriter("c", "m", "default", False, decode, True)
    chunks = [
        writer.delta(0, " f", [lp(2, -1.0)]),
        writer.delta(1, "def", [lp(1, -2.0)]),
        writer.delta(0, "(x):", [lp(3, -1.0), lp(4, -1.0)]),
        writer.delta(1, " f", [lp(2, -2.0)], "length"),
    ]
    offsets = [e["choices"][0]["logprobs"]["text_offset"] for e in events(chunks)]
    assert offsets == [[0], [0], [2, 4], [3]]
    writer = ChunkWriter("c", "m", "default", False, decode, True)
    echo, first = events(
        [
            writer.echo(0, "def f", ([1, 2], [None, lp(2, -1.0)])),
            writer.delta(0, "(x", [lp(3, -0.5)]),
        ]
    )
    assert echo["choices"][0]["text"] == "def f"
    assert echo["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0]
    assert echo["choices"][0]["logprobs"]["text_offset"] == [0, 3]
    assert first["choices"][0]["logprobs"]["text_offset"] == [5]
    no_logprobs = ChunkWriter("c", "m", "default", False, decode, False)
    assert events([no_logprobs.echo(0, "def", None)])[0]["choices"][0]["logprobs"] is None
