"""Splits a choice's generated text into content and tool calls, incrementally.

Fed the text deltas as they are detokenized, it returns events in stream order: content text,
a call's start (id and name, once the name's string has closed), its argument fragments (the
arguments' JSON text exactly as generated, so the fragments concatenate to the final string,
`{}` and braces inside strings included) and its end (the moment the call's object closes:
the agent fast path dispatches it then). The grammar makes the model write the format
exactly; the parser still tolerates whitespace between JSON tokens and keys in any order
(templates without our grammar), and turns anything else back into content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ultrafast.server.tools.formats import ToolFormat

_WS = " \t\r\n"


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    index: int
    fragment: str
    id: str = ""  # the call's id (as in its CallStart)


@dataclass
class CallDone:
    index: int
    id: str
    name: str
    arguments: str
    complete: bool = True  # False: the output ended (max_tokens) inside the call


Event = Content | CallStart | CallArgs | CallDone


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _RawValue:
    """One JSON value's text, char by char: knows when it has ended, without parsing it."""

    def __init__(self) -> None:
        self.started = False
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.scalar = False

    def feed(self, ch: str) -> str:
        """'skip' (whitespace before the value), 'more', 'done' (ch is the value's last
        char) or 'after' (the value ended before ch, which belongs to the parent)."""
        if not self.started:
            if ch in _WS:
                return "skip"
            self.started = True
            if ch in "{[":
                self.depth = 1
                return "more"
            if ch == '"':
                self.in_string = True
                return "more"
            if ch in ",:}]":
                raise ValueError("a value was expected")
            self.scalar = True
            return "more"
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                return "done" if self.depth == 0 else "more"
            return "more"
        if self.scalar:
            return "after" if ch in _WS or ch in ",}]" else "more"
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                return "done"
        return "more"


@dataclass
class _Call:
    """The call object being read: `{ "key": value, ... }`."""

    index: int
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    args: str = ""
    has_args: bool = False
    started: bool = False  # CallStart sent
    sent_args: int = 0  # chars of args sent
    state: str = "open"  # open, key, colon, value, after
    key: str = ""
    value: _RawValue | None = None
    value_text: str = ""


class ToolCallParser:
    def __init__(self, fmt: ToolFormat, first_index: int = 0):
        self.fmt = fmt
        self.trigger = fmt.trigger
        self.begin = _strip_ws(fmt.begin)
        self.end = _strip_ws(fmt.end)
        self.separator = _strip_ws(fmt.separator)
        self.mode = "text"  # text, literal, call, between
        self.pending = ""  # text that may be the start of a trigger
        self.held_ws = ""  # whitespace after a call: content only if text follows
        self.literal = ""  # what the literal mode must still read
        self.after_literal = ""  # the mode after it
        self.raw = ""  # the block's text since its trigger (content again if it breaks)
        self.call: _Call | None = None
        self.next_index = first_index
        self.broken = False  # a call broke after it started: the rest is content
        self.calls: list[CallDone] = []
        self._out: list[Event] = []

    # ---- API -------------------------------------------------------------------------------

    def push(self, text: str) -> list[Event]:
        for ch in text:
            self._char(ch)
        return self._take()

    def finish(self, cut: bool = False) -> list[Event]:
        """The output ended: a started call ends incomplete. `cut`: it ended at max_tokens,
        so the text held back (a trigger's first chars, a block's markup before its call's
        name, a call's closing text) is markup that was cut, never content; otherwise what
        is held becomes content, except a whole call's closing text."""
        call = self.call
        if call is not None and call.started:
            self._args_out(call)
            done = CallDone(call.index, call.id, call.name or "", call.args, complete=False)
            self.calls.append(done)
            self._out.append(done)
        elif self.mode != "text" and self.raw and not cut and not self._closing():
            self._content(self.raw)
        if not cut:
            self._content(self.pending)
        self.pending, self.raw, self.call, self.mode = "", "", None, "text"
        return self._take()

    def _closing(self) -> bool:
        """Reading the closing text after a whole call."""
        return self.mode == "literal" and self.after_literal == "text"

    # ---- state machine ----------------------------------------------------------------------

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        merged: list[Event] = []
        for e in out:
            last = merged[-1] if merged else None
            if isinstance(e, Content) and isinstance(last, Content):
                merged[-1] = Content(last.text + e.text)
            elif isinstance(e, CallArgs) and isinstance(last, CallArgs) and last.index == e.index:
                merged[-1] = CallArgs(e.index, last.fragment + e.fragment, e.id)
            elif not (isinstance(e, Content) and not e.text):
                merged.append(e)
        return merged

    def _content(self, text: str) -> None:
        if text:
            self._out.append(Content(text))

    def _char(self, ch: str) -> None:
        if self.broken:
            self._content(ch)
            return
        if self.mode == "text":
            self._text_char(ch)
            return
        self.raw += ch
        try:
            if self.mode == "literal":
                self._literal_char(ch)
            elif self.mode == "call":
                self._call_char(ch)
            elif self.mode == "between":
                self._between_char(ch)
        except ValueError:
            self._break()

    def _text_char(self, ch: str) -> None:
        self.pending += ch
        if self.trigger.startswith(self.pending):
            if self.pending == self.trigger:
                self._open_block()
            return
        # not a trigger prefix: release all but the longest suffix that still may be one
        keep = _longest_prefix_suffix(self.pending, self.trigger)
        released = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(released) :]
        if self.calls and released.strip(_WS) == "":
            self.held_ws += released  # whitespace between calls: dropped if a call follows
            return
        self._content(self.held_ws + released)
        self.held_ws = ""

    def _open_block(self) -> None:
        self.raw, self.pending, self.held_ws = self.trigger, "", ""
        self._expect(self.begin, "call")
        if self.fmt.trigger_in_call:  # the trigger was the call's own first chars
            self.mode = "call"
            self.call = _Call(self.next_index)
            for c in self.trigger:
                self._call_char(c)

    def _expect(self, literal: str, then: str) -> None:
        self.literal, self.after_literal = literal, then
        self.mode = "literal" if literal else then
        if then == "call" and not literal:
            self.call = _Call(self.next_index)

    def _literal_char(self, ch: str) -> None:
        if ch in _WS and not self.literal.startswith(ch):
            return
        if not self.literal.startswith(ch):
            raise ValueError("the format's text was expected")
        self.literal = self.literal[1:]
        if not self.literal:
            self._expect("", self.after_literal)
            if self.mode == "text":
                self.raw = ""

    def _between_char(self, ch: str) -> None:
        """Array formats: after a call, `,` and the next call, or the block's end."""
        if ch in _WS:
            return
        if self.separator and ch == self.separator[0]:
            self._expect(self.separator[1:], "call")
        elif self.end and ch == self.end[0]:
            self._expect(self.end[1:], "text")
            if self.mode == "text":
                self.raw = ""
        else:
            raise ValueError("',' or the end of the calls was expected")

    def _call_char(self, ch: str) -> None:
        call = self.call
        assert call is not None
        if call.state == "open":
            if ch in _WS:
                return
            if ch != "{":
                raise ValueError("a call object was expected")
            call.state = "key"
        elif call.state == "key":
            self._key_char(call, ch)
        elif call.state == "colon":
            if ch in _WS:
                return
            if ch != ":":
                raise ValueError("':' was expected")
            call.state, call.value, call.value_text = "value", _RawValue(), ""
        elif call.state == "value":
            self._value_char(call, ch)
        elif call.state == "after":
            if ch in _WS:
                return
            if ch == ",":
                call.state, call.key = "key", ""
            elif ch == "}":
                self._close_call(call)
            else:
                raise ValueError("',' or '}' was expected")

    def _key_char(self, call: _Call, ch: str) -> None:
        if not call.key:
            if ch in _WS:
                return
            if ch == "}" and call.name is None:
                raise ValueError("a call needs a name")
            if ch != '"':
                raise ValueError("a key was expected")
            call.key = ch
            return
        body = call.key
        call.key += ch
        backslashes = len(body) - len(body.rstrip("\\"))
        if ch == '"' and backslashes % 2 == 0:  # an unescaped quote closes the key
            call.key = json.loads(call.key)
            call.state = "colon"

    def _value_char(self, call: _Call, ch: str) -> None:
        assert call.value is not None
        status = call.value.feed(ch)
        if status == "skip":
            return
        if status == "after":
            self._value_done(call)
            self._call_char(ch)
            return
        call.value_text += ch
        if call.key == self.fmt.args_key:
            call.args, call.has_args = call.value_text, True
            self._args_out(call)
        if status == "done":
            self._value_done(call)

    def _value_done(self, call: _Call) -> None:
        if call.key == "name":
            name = json.loads(call.value_text)
            if not isinstance(name, str) or call.name is not None:
                raise ValueError("a call's name must be one string")
            call.name = name
            call.started = True
            self._out.append(CallStart(call.index, call.id, name))
            self._args_out(call)
        call.state, call.key, call.value = "after", "", None

    def _args_out(self, call: _Call) -> None:
        if call.started and len(call.args) > call.sent_args:
            self._out.append(CallArgs(call.index, call.args[call.sent_args :], call.id))
            call.sent_args = len(call.args)

    def _close_call(self, call: _Call) -> None:
        if call.name is None:
            raise ValueError("a call needs a name")
        if not call.has_args:  # a call without arguments: OpenAI's spelling of none
            call.args = "{}"
            self._args_out(call)
        done = CallDone(call.index, call.id, call.name, call.args)
        self.calls.append(done)
        self._out.append(done)
        self.next_index += 1
        self.call = None
        self.raw = ""  # what follows a whole call is the format's closing text, never content
        if self.fmt.array:
            self.mode = "between"
        else:
            self._expect(self.end, "text")
            if self.mode == "text":
                self.raw = ""

    def _break(self) -> None:
        """The text is not a call after all: content, unless a call already started."""
        call = self.call
        if call is not None and call.started:
            self.broken = True
            self._args_out(call)
            done = CallDone(call.index, call.id, call.name or "", call.args, complete=False)
            self.calls.append(done)
            self._out.append(done)
            self._content(self.raw[-1:])
        else:
            self._content(self.raw)
        self.raw, self.call, self.mode = "", None, "text"


def _strip_ws(text: str) -> str:
    return "".join(ch for ch in text if ch not in _WS)


def _longest_prefix_suffix(text: str, trigger: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `trigger`."""
    for n in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0
