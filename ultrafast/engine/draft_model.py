"""The draft model of speculative decoding: a small model with the target's tokenizer on its own
executor (same kind as the target's), one KV slot per target slot id.

Before drafting, each request's draft KV catches up on the tokens it has not seen (the prompt,
the target's accepted tokens); rejected drafts are dropped by starting the next feed at the
first wrong position (the executor trims the slot there). All requests draft in one batch per
draft position. Greedy requests draft greedily (q one-hot); sampled requests draw from the
draft model's own processed distribution and hand q to `sampling.sampler.verify`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ultrafast.core.types import Draft, ScheduledSeq, StepPlan
from ultrafast.request import Request, SamplingParams
from ultrafast.sampling.sampler import _mix_seed, draw, target_probs

_DRAFT_SEED_SALT = 0x5DEECE66D  # the draft model's draws use other generators than the target's


_GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1)
DEFAULT_BATCH_TOKENS = 512  # tokens one drafting pass holds when the executor sets no limit


@dataclass
class _DraftKV:
    """What the draft model's KV of one request holds."""

    slot_id: int
    token_ids: list[int]  # tokens whose KV is in the draft slot, in order
    num_valid: int  # token_ids[:num_valid] is known to equal the request's context


class DraftModelProposer:
    """propose() for the requests that fell through to the draft model; release() when one
    finishes. `per_draft_s` (measured) is what a draft token costs the step."""

    def __init__(self, executor):
        self.executor = executor
        caps = executor.caps()
        self.max_batch_tokens = caps.max_step_tokens or DEFAULT_BATCH_TOKENS
        self._reads_logits = caps.last_logits  # its q for sampled drafts (else: greedy drafts)
        self.per_draft_s = 0.3e-3  # measured: draft-model time per drafted token (EWMA)
        self._kv: dict[str, _DraftKV] = {}
        self._slot_owner: dict[int, str] = {}

    def release(self, request_id: str) -> None:
        self._kv.pop(request_id, None)

    def close(self) -> None:
        self.executor.close()

    def _catch_up_feed(self, request: Request) -> tuple[int, list[int]]:
        """(start position, tokens to feed) so the draft KV holds the whole context."""
        rid, context = request.request_id, request.all_token_ids
        kv = self._kv.get(rid)
        slot_id = request.held_slot_id
        if kv is None or kv.slot_id != slot_id or self._slot_owner.get(kv.slot_id) != rid:
            kv = self._kv[rid] = _DraftKV(slot_id, [], 0)
            self._slot_owner[slot_id] = rid
        valid = min(kv.num_valid, len(context))
        limit = min(len(kv.token_ids), len(context) - 1)  # the last token is always fed
        while valid < limit and kv.token_ids[valid] == context[valid]:
            valid += 1
        valid = min(valid, len(context) - 1)
        del kv.token_ids[valid:]
        kv.num_valid = valid
        return valid, context[valid:]

    def propose(self, wants: list[tuple[Request, int]]) -> dict[str, Draft]:
        start_s = time.perf_counter()
        drafts = self._propose(wants)
        num_tokens = sum(len(d.token_ids) for d in drafts.values())
        if num_tokens:  # a batch shares the passes: the time per token the step pays
            per_token_s = (time.perf_counter() - start_s) / num_tokens
            self.per_draft_s += 0.2 * (per_token_s - self.per_draft_s)
        return drafts

    def _propose(self, wants: list[tuple[Request, int]]) -> dict[str, Draft]:
        wants = [(r, min(k, self.executor.max_model_len - r.num_tokens)) for r, k in wants]
        wants = [(r, k) for r, k in wants if k > 0]
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in wants}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in wants}
        feeds = {r.request_id: self._catch_up_feed(r) for r, _ in wants}
        by_id = {r.request_id: r for r, _ in wants}
        while feeds:  # catch up (chunked to the draft batch); the last chunk yields draft 1
            seqs, budget = [], self.max_batch_tokens
            for rid, (start, feed) in feeds.items():
                n = min(len(feed), budget)
                if n <= 0:
                    break
                seqs.append(self._seq(by_id[rid], feed[:n], start, 1 if n == len(feed) else 0))
                budget -= n
            self._run(seqs, drafts, probs, by_id)
            for seq in seqs:
                start, feed = feeds.pop(seq.request_id)
                if seq.num_tokens < len(feed) and seq.request_id in self._kv:
                    feeds[seq.request_id] = (start + seq.num_tokens, feed[seq.num_tokens :])
        for j in range(1, max((k for _, k in wants), default=0)):  # drafts 2..k, batched
            seqs = [
                self._seq(r, drafts[r.request_id][-1:], r.num_tokens + j - 1, 1)
                for r, k in wants
                if k > j and len(drafts[r.request_id]) == j
            ]
            if not seqs:
                break
            self._run(seqs, drafts, probs, by_id)
        out = {}
        for r, _ in wants:
            tokens, rows = drafts[r.request_id], probs[r.request_id]
            if tokens:
                out[r.request_id] = Draft(tokens, torch.stack(rows) if rows else None, "draft")
        return out

    @staticmethod
    def _seq(request: Request, token_ids: list[int], start: int, num_logits: int) -> ScheduledSeq:
        return ScheduledSeq(
            request.request_id,
            request.held_slot_id,
            token_ids,
            start,
            num_logits,
            _GREEDY_ONE,
            0,
            0,
        )

    def _run(self, seqs: list[ScheduledSeq], drafts: dict, probs: dict, by_id: dict) -> None:
        # in slot order, the order the ggml executor runs (and returns logits rows in)
        seqs = sorted(seqs, key=lambda s: s.slot_id)
        result = self.executor.execute(StepPlan(seqs))
        logits = self.executor.last_logits if self._reads_logits else None
        row = 0
        for seq in seqs:
            rid = seq.request_id
            if rid in result.errors:  # this request drafts nothing this step
                self._kv.pop(rid, None)
                drafts[rid] = []
                continue
            kv = self._kv[rid]
            kv.token_ids.extend(seq.token_ids)
            if not seq.num_logits:
                continue
            token = result.sampled_token_ids[rid][0]
            request = by_id[rid]
            if not request.sampling_params.greedy and logits is not None:
                token, q = self._sample_draft(request, logits[row], drafts[rid])
                probs[rid].append(q)
            drafts[rid].append(token)
            row += 1

    @staticmethod
    def _sample_draft(request: Request, raw, drafts_so_far: list[int]) -> tuple[int, torch.Tensor]:
        """A draw from the draft model's processed distribution q (returned for verify)."""
        raw = torch.from_numpy(raw.copy()) if not isinstance(raw, torch.Tensor) else raw.float()
        output = request.output_token_ids
        index = request.num_output_tokens + len(drafts_so_far)
        view = ScheduledSeq(
            request.request_id,
            request.slot_id or 0,
            [],
            0,
            1,
            request.sampling_params,
            request.sampling_seed,
            index,
            request.prompt_token_ids,
            output,
        )
        history = output + drafts_so_far if request.sampling_params.needs_penalties else []
        q = target_probs(raw.clone(), view, history)
        generator = torch.Generator().manual_seed(
            _mix_seed(request.sampling_seed ^ _DRAFT_SEED_SALT, index)
        )
        return draw(q, generator), q
