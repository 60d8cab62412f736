"""A deterministic, tensor-free executor for load and fault tests (`serve --executor fake`).

Testing only: it serves the real tokenizer's vocabulary but no model. Its "KV" is the token list
held in each slot, and the next token is a hash of the whole sequence in the slot, drawn from a
fixed set of plain word tokens (never EOS or a special token). So a client that knows the prompt
ids can compute every token the server must send (`reference_tokens`), and any scheduler or
streaming mistake (a lost, repeated or reordered token, a stale KV slot) changes the output.

Each step sleeps `step_s` (a configurable engine speed, e.g. 20 ms = 50 tok/s per stream).

Fault hook (the spec's "evil forward"): a prompt that starts with FAULT_MARKER, then a mode
and an output index k, fails in the step that would produce its output token k (k = 0: the
prefill, before the first token). Modes: FAULT_REQUEST fails that request alone (the other
requests of the step are unaffected); FAULT_STEP raises from execute(), failing the whole step;
FAULT_FATAL raises a BaseException, which kills the engine thread (a dead engine).
"""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path

from ultrafast.core.types import StepPlan, StepResult
from ultrafast.executors.fake_scoring import score_prompt

# Ids that no real prompt text tokenizes to in this order; only token-id prompts carry them.
FAULT_MARKER = (3, 1, 4, 1, 5)
FAULT_REQUEST, FAULT_STEP, FAULT_FATAL = 1, 2, 3


class FatalFault(BaseException):
    """Not an Exception: the engine's per-step handler does not catch it, so the thread dies."""

_PLAIN_WORD = re.compile(r"^\u0120[a-z]{2,8}$")  # "Ġword": decodes to " word", no byte pieces


def plain_word_tokens(tokenizer_json: Path | str) -> list[int]:
    """Ids of the vocabulary's " word" tokens: any sequence of them decodes unambiguously."""
    from tokenizers import Tokenizer as HFTokenizer

    vocab = HFTokenizer.from_file(str(tokenizer_json)).get_vocab(with_added_tokens=False)
    ids = sorted(i for t, i in vocab.items() if _PLAIN_WORD.match(t))
    if len(ids) < 16:
        raise ValueError("the fake executor needs a byte-level BPE vocabulary with word tokens")
    return ids


def next_token(context: list[int], word_ids: list[int]) -> int:
    digest = hashlib.sha256(repr(context).encode()).digest()
    return word_ids[int.from_bytes(digest[:4], "little") % len(word_ids)]


def reference_tokens(prompt: list[int], max_tokens: int, word_ids: list[int]) -> list[int]:
    """The exact output of one request (every sampling setting is ignored: greedy-like)."""
    context, out = list(prompt), []
    for _ in range(max_tokens):
        token = next_token(context, word_ids)
        out.append(token)
        context.append(token)
    return out


def fault_of(prompt: list[int]) -> tuple[int, int] | None:
    """(mode, output index) of a marked prompt, or None for a normal prompt."""
    n = len(FAULT_MARKER)
    if len(prompt) > n + 1 and tuple(prompt[:n]) == FAULT_MARKER:
        return prompt[n], prompt[n + 1]
    return None


def fault_prompt(mode: int, at_output: int, tail: list[int]) -> list[int]:
    return [*FAULT_MARKER, mode, at_output, *tail]


class FakeExecutor:
    def __init__(self, tokenizer_json: Path | str, num_slots: int = 8,
                 max_model_len: int = 2048, step_s: float = 0.02):
        from tokenizers import Tokenizer as HFTokenizer

        self.word_ids = plain_word_tokens(tokenizer_json)
        self.vocab_size = HFTokenizer.from_file(str(tokenizer_json)).get_vocab_size(True)
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.slots: list[list[int]] = [[] for _ in range(num_slots)]

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        result = StepResult()
        for copy in plan.kv_copies:
            if len(self.slots[copy.src_slot_id]) < copy.num_tokens:
                raise RuntimeError("prefix copy of KV that was never computed")
            self.slots[copy.dst_slot_id] = list(self.slots[copy.src_slot_id][:copy.num_tokens])
        for seq in plan.seqs:
            kv = self.slots[seq.slot_id]
            if len(kv) < seq.start_position:
                raise RuntimeError("gap in the KV: a position was skipped")
            del kv[seq.start_position:]  # the contract: drop stale KV at and past start
            kv.extend(seq.token_ids)
            if len(kv) > self.max_model_len:
                raise RuntimeError("KV slot overflow")
            fault = fault_of(seq.prompt_token_ids)
            if fault is not None and seq.num_logits and seq.num_output_tokens >= fault[1]:
                if fault[0] == FAULT_FATAL:
                    raise FatalFault("injected fatal engine fault")
                if fault[0] == FAULT_STEP:
                    raise RuntimeError("injected step fault")
                result.errors[seq.request_id] = "injected fault"
                continue
            if seq.num_prompt_logits:  # prompt logprobs (executors/fake_scoring.py)
                result.prompt_logprobs[seq.request_id] = score_prompt(
                    kv, seq, lambda context: next_token(context, self.word_ids))
            if seq.num_logits:
                n = len(kv)
                result.sampled_token_ids[seq.request_id] = [
                    next_token(kv[:n - seq.num_logits + 1 + j], self.word_ids)
                    for j in range(seq.num_logits)]
        if self.step_s:
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        result.execute_time_s = time.perf_counter() - started
        return result

    def close(self) -> None:
        pass
