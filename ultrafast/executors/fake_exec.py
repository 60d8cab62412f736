"""A deterministic, tensor-free executor for tests: unit tests, and load and fault tests through
`serve --executor fake`.

Testing only: no model. Its "KV" is the token list held in each slot, and the next token is a
hash of the whole sequence in the slot, drawn from a fixed set of output ids. So a test that
knows the prompt ids can compute every token the engine must produce (`reference_tokens`), and
any scheduling or streaming mistake (a wrong position, a stale or missing KV entry, a bad prefix
copy, a lost, repeated or reordered token) changes the output. Every sampling setting is ignored
(the output is greedy-like).

Two alphabets: without a tokenizer, ids 0 .. vocab_size - 1 (unit tests); with one
(`for_tokenizer`), the vocabulary's plain word tokens, never EOS or a special token, so any
output decodes by concatenation.

Fault hooks. A prompt that starts with FAULT_MARKER, then a mode and an output index k, fails
in the step that would produce its output token k (k = 0: the prefill, before the first token).
Modes: FAULT_REQUEST fails that request alone (the other requests of the step are unaffected);
FAULT_STEP raises from execute(), failing the whole step; FAULT_FATAL raises a BaseException,
which kills the engine thread (a dead engine). Unit tests can also fail a request by id
(`fail_request_ids`).
"""

from __future__ import annotations

import hashlib
import re
import struct
import time
from collections.abc import Sequence
from pathlib import Path

from ultrafast.core.types import ScheduledSeq, StepPlan, StepResult
from ultrafast.executors.base import ExecutorCaps
from ultrafast.executors.fake_scoring import score_prompt
from ultrafast.kvcache.fingerprint import kv_fingerprint

# Ids that no real prompt text tokenizes to in this order; only token-id prompts carry them.
FAULT_MARKER = (3, 1, 4, 1, 5)
FAULT_REQUEST, FAULT_STEP, FAULT_FATAL = 1, 2, 3

UNIT_VOCAB_SIZE = 97  # the tokenizer-free alphabet: ids 0 .. 96


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


def next_token(context: list[int], output_ids: Sequence[int]) -> int:
    """The token that follows `context`: a hash of all of it, picked from `output_ids`."""
    digest = hashlib.sha256(repr(context).encode()).digest()
    return output_ids[int.from_bytes(digest[:4], "little") % len(output_ids)]


def reference_tokens(
    prompt: list[int], max_tokens: int, output_ids: Sequence[int] = range(UNIT_VOCAB_SIZE)
) -> list[int]:
    """The exact output of one request alone (no eos, no stop)."""
    context, out = list(prompt), []
    for _ in range(max_tokens):
        token = next_token(context, output_ids)
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
    keeps_logits = True  # executors/base.py KeptSampling (a test may turn it off)

    def __init__(
        self,
        num_slots: int = 4,
        max_model_len: int = 256,
        vocab_size: int = UNIT_VOCAB_SIZE,
        output_ids: Sequence[int] | None = None,
        step_s: float = 0.0,
        keep_plans: bool = True,
    ):
        """output_ids: the ids outputs are drawn from (default: the whole vocabulary).
        step_s: each step lasts at least this long (a simulated engine speed).
        keep_plans: record every executed plan in `plans` (for tests' assertions)."""
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.output_ids: Sequence[int] = range(vocab_size) if output_ids is None else output_ids
        self.step_s = step_s
        self.keep_plans = keep_plans
        self.plans: list[StepPlan] = []
        self.fail_request_ids: set[str] = set()
        self.slots: list[list[int]] = [[] for _ in range(num_slots)]

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer_json: Path | str,
        num_slots: int = 8,
        max_model_len: int = 2048,
        step_s: float = 0.02,
    ) -> FakeExecutor:
        """Over a real tokenizer's vocabulary, emitting its plain word tokens (a server's
        executor: no plan records)."""
        from tokenizers import Tokenizer as HFTokenizer

        vocab_size = HFTokenizer.from_file(str(tokenizer_json)).get_vocab_size(True)
        return cls(
            num_slots,
            max_model_len,
            vocab_size,
            plain_word_tokens(tokenizer_json),
            step_s,
            keep_plans=False,
        )

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        if self.keep_plans:
            self.plans.append(plan)
        result = StepResult()
        for copy in plan.kv_copies:
            if len(self.slots[copy.src_slot_id]) < copy.num_tokens:
                raise RuntimeError("prefix copy of KV that was never computed")
            self.slots[copy.dst_slot_id] = list(self.slots[copy.src_slot_id][: copy.num_tokens])
        for seq in plan.seqs:
            if seq.request_id in self.fail_request_ids:
                result.errors[seq.request_id] = "injected failure"
                continue
            kv = self.slots[seq.slot_id]
            if len(kv) < seq.start_position:
                raise RuntimeError("gap in the KV: a position was skipped")
            del kv[seq.start_position :]  # the contract: drop stale KV at and past start
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
                    kv, seq, lambda context: next_token(context, self.output_ids)
                )
            if seq.defer_sample:  # the "logits": the context the next token depends on
                result.kept_logits[seq.request_id] = list(kv)
            elif seq.num_logits:
                n = len(kv)
                result.sampled_token_ids[seq.request_id] = [
                    next_token(kv[: n - seq.num_logits + 1 + j], self._choices(seq, j))
                    for j in range(seq.num_logits)
                ]
        if self.step_s:
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        result.execute_time_s = time.perf_counter() - started
        return result

    def caps(self) -> ExecutorCaps:
        return ExecutorCaps(keeps_logits=self.keeps_logits)

    def sample_kept(self, seq: ScheduledSeq, kept) -> StepResult:
        token = next_token(kept, self._choices(seq, 0))
        return StepResult(sampled_token_ids={seq.request_id: [token]})

    # KV export/import (kvcache/): the "KV" is the slot's token list, so a wrong import shows
    # up as wrong output tokens
    def kv_fingerprint(self) -> str:
        outputs = hashlib.sha256(str(list(self.output_ids)).encode()).hexdigest()
        return kv_fingerprint(executor="fake", vocab_size=self.vocab_size, outputs=outputs)

    def export_slot(self, slot_id: int, num_tokens: int) -> bytes:
        held = self.slots[slot_id]
        if not 0 < num_tokens <= len(held):
            raise ValueError(f"slot {slot_id} holds {len(held)} positions")
        return struct.pack(f"<{len(held)}i", *held)

    def import_slot(self, slot_id: int, payload: bytes, num_tokens: int) -> None:
        self.slots[slot_id] = []
        if len(payload) % 4 or len(payload) // 4 < num_tokens:
            raise ValueError("KV payload is truncated")
        self.slots[slot_id] = list(struct.unpack(f"<{len(payload) // 4}i", payload))[:num_tokens]

    def _choices(self, seq, row: int) -> Sequence[int]:
        """The ids position `row` may produce: the alphabet, or what the grammar allows."""
        if seq.token_mask is None:
            return self.output_ids
        from ultrafast.grammar.mask import allowed_ids  # numpy only: no torch here

        return allowed_ids(seq.token_mask[row], self.vocab_size)

    def close(self) -> None:
        pass
