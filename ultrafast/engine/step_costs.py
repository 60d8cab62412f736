"""The engine's measured step cost: how long a step of n sequences and t tokens takes.

Fitted online from every step the engine runs. The engine sizes its steps from it
(`StepBudget`), the speculator sizes its draft length from it, and admission predicts time to
first token from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ultrafast.request import ServiceTier

MAX_TABULATED_STEP_TOKENS = 16  # lone steps up to this many tokens are timed per size


class StepCostModel:
    """Step time ~ base_s + per_seq_s * (num_seqs - 1) + per_token_s * num_tokens, fitted online
    (exponentially weighted least squares), plus the time of a lone single-token step.

    Sizes each step while a priority request decodes, so its inter-token gap stays within
    target however much other work is waiting. A sequence and a token are fitted apart: on a
    CPU one more 1-token decode in a step can cost several prefill tokens' time (its own KV
    stream, sampling, output), so a token count alone mispredicts a step of many decodes.
    """

    def __init__(self, forget: float = 0.05):
        self.forget = forget
        self._sums = [0.0] * 9  # weight, s, t, y, ss, tt, st, sy, ty (s = num_seqs - 1)
        self._base_s: float | None = None  # one sequence: base_s + per_token_s * num_tokens
        self._per_token_s: float | None = None
        self._per_seq_s = 0.0  # each sequence past the first (0 until the data can tell)
        self._stale = False  # observed since the last fit: fitted when a figure is read
        self.single_decode_s: float | None = None  # one sequence, one token: the idle ITL
        # forward pass + sampling of one sequence's step of n tokens (index n), measured apart:
        # on a CPU the first extra token costs far more than the line says, which sizes
        # speculation's k (scripts/verify_pass_width.py measures a pass by width)
        self.lone_pass_s: list[float | None] = [None] * (MAX_TABULATED_STEP_TOKENS + 1)

    # The fit is made when read, not at every step: a lone stream's steps never read it, and
    # the fit's Python would add to every step's host-side time (scripts/host_step_time.py).
    @property
    def base_s(self) -> float | None:
        self._refit()
        return self._base_s

    @property
    def per_token_s(self) -> float | None:
        self._refit()
        return self._per_token_s

    @property
    def per_seq_s(self) -> float:
        self._refit()
        return self._per_seq_s

    def _refit(self) -> None:
        if self._stale:
            self._stale = False
            self._fit()

    def observe(
        self, num_seqs: int, num_tokens: int, elapsed_s: float, pass_s: float | None = None
    ) -> None:
        """One step: its sequences, tokens and time; `pass_s`, the part that was the forward
        pass and sampling (without drafting), feeds `lone_pass_s`."""
        if num_tokens == 0 or elapsed_s <= 0:
            return
        if num_seqs == 1 and num_tokens == 1:
            self.single_decode_s = _ema(self.single_decode_s, elapsed_s, 0.1)
        if num_seqs == 1 and num_tokens <= MAX_TABULATED_STEP_TOKENS and pass_s:
            self.lone_pass_s[num_tokens] = _ema(self.lone_pass_s[num_tokens], pass_s, 0.2)
        keep = 1.0 - self.forget
        s, t, y = float(num_seqs - 1), float(num_tokens), elapsed_s
        new = (1.0, s, t, y, s * s, t * t, s * t, s * y, t * y)
        self._sums = [v * keep + d for v, d in zip(self._sums, new)]
        self._stale = True

    def _fit(self) -> None:
        _, s, t, y, ss, tt, st, sy, ty = (v / self._sums[0] for v in self._sums)
        var_s, var_t, cov_st = ss - s * s, tt - t * t, st - s * t
        cov_sy, cov_ty = sy - s * y, ty - t * y
        if var_t <= 0.5:  # not enough spread in step sizes to trust a slope
            return
        det = var_s * var_t - cov_st * cov_st
        if var_s > 0.25 and det > 0.05 * var_s * var_t:  # sequences and tokens vary apart
            per_seq = (cov_sy * var_t - cov_ty * cov_st) / det
            per_token = (cov_ty * var_s - cov_sy * cov_st) / det
            if per_seq >= 0 and per_token > 0:
                self._per_seq_s, self._per_token_s = per_seq, per_token
                self._base_s = max(y - per_seq * s - per_token * t, 0.0)
                return
        slope = cov_ty / var_t
        if slope <= 0:
            return
        known = self._per_token_s
        if var_s > 0.25 and known is not None and known < slope:
            # sequences grew with tokens (decode steps only): the slope is what one more
            # decode costs, its own KV read included (~2.3 ms at 1,000 positions against
            # ~0.2 ms a prompt token, 2-core AMX Xeon). As a token's cost it priced 16 queued
            # 1,000-token prompts at ~32 s and refused them (429); a token keeps its last
            # measured cost and the rest of the slope is the sequence's
            self._per_seq_s = slope - known
            self._base_s = max(y - self._per_seq_s * s - known * t, 0.0)
            return
        # tokens alone (e.g. a single stream: prefills and decodes)
        self._per_seq_s, self._per_token_s = 0.0, slope
        self._base_s = max(y - slope * t, 0.0)

    def token_budget(self, target_s: float, minimum: int = 1) -> int | None:
        """Tokens a step may hold and still take <= target_s, counting every token past the
        first as a sequence of its own (the dearest way to spend it)."""
        base_s, per_token_s = self.base_s, self.per_token_s
        if base_s is None or per_token_s is None:
            return None
        first_s = base_s + per_token_s
        return max(minimum, 1 + int((target_s - first_s) / (per_token_s + self._per_seq_s)))

    def auto_itl_target_s(self, factor: float = 1.2) -> float | None:
        """`factor` times the idle inter-token time, once it has been measured.

        Once the model is fitted, the idle time is its own prediction of a lone decode, so
        target and budget come from one line: a measured lone decode carries noise (a
        longer context, the HTTP thread on the same core) and a high reading once let a
        second sequence into every priority step, slowing it by half."""
        base_s, per_token_s = self.base_s, self.per_token_s
        if base_s is not None and per_token_s is not None:
            return factor * (base_s + per_token_s)
        return None if self.single_decode_s is None else factor * self.single_decode_s


class StepBudget:
    """Token budgets of the next step, from the tiers running now and the measured costs:
    the priority cap while a priority request runs (its inter-token gap stays within target
    however much other work waits), else the default tier's while its decodes run."""

    def __init__(
        self, priority_itl_target_s: float | None = None, default_itl_target_s: float | None = None
    ):
        """priority_itl_target_s: None = no cap on steps carrying priority work, 0 = auto
        (1.2x the idle inter-token time). default_itl_target_s: None = no cap."""
        self.priority_itl_target_s = priority_itl_target_s
        self.default_itl_target_s = default_itl_target_s
        # tokens a step with priority work may hold (Scheduler.schedule), None = no cap; kept
        # from the last step that had a priority request running
        self.priority_tokens: int | None = None
        # the same for steps whose tightest tier is the default one (no priority running)
        self.step_tokens: int | None = None

    def resize(self, costs: StepCostModel, running_tiers: Iterable[ServiceTier]) -> None:
        """After a step: the budgets for the next one, priority first."""
        tiers = set(running_tiers)
        self.step_tokens = None
        if ServiceTier.PRIORITY in tiers:
            target_s: float | None = self.priority_itl_target_s
            if target_s == 0:  # auto: stay within 1.2x of the idle inter-token time
                target_s = costs.auto_itl_target_s()
            if target_s:  # the cap applies from the next step, to priority steps only
                self.priority_tokens = costs.token_budget(target_s)
        elif ServiceTier.DEFAULT in tiers and self.default_itl_target_s:
            self.step_tokens = costs.token_budget(self.default_itl_target_s)

    def capped(self, cap: int | None) -> int | None:
        """The default budget under a further cap (None: none)."""
        if cap is None:
            return self.step_tokens
        return cap if self.step_tokens is None else min(self.step_tokens, cap)


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


@dataclass
class StepStats:
    """One step's numbers, for metrics (only server/metrics.py turns them into Prometheus)."""

    step_id: int
    num_seqs: int
    num_tokens: int
    num_running: int
    num_waiting: int
    schedule_time_s: float
    execute_time_s: float
    sample_time_s: float
    update_time_s: float
    propose_time_s: float = 0.0  # speculative drafting before the step (draft model, lookups)
    num_draft_tokens: int = 0  # drafts scheduled in this step
