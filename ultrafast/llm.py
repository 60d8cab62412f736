"""Offline API: `LLM(model).generate(prompts, params)`, and the factory that builds an engine.

Same engine core as the server, driven synchronously on the caller's thread.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard, cast

from ultrafast import early_open
from ultrafast.config import DEMO_DRAFT_DIR, EngineConfig, default_model_choice
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.core.types import TokenLogprobs
from ultrafast.engine.core import EngineCore
from ultrafast.engine.draft_model import DraftModelProposer
from ultrafast.engine.speculation import SpeculationConfig, Speculator
from ultrafast.engine_sizing import (
    executor_kind,
    ggml_executor_args,
    sized,
)
from ultrafast.kvcache.manager import KVCacheConfig
from ultrafast.model_files import (
    ModelFiles,
    load_tokenizer,
    resolve_model,
    tokenizer_fingerprint,
)
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.tokenizer import StopStringMatcher, Tokenizer

log = logging.getLogger(__name__)


def build_executor(config: EngineConfig, files: ModelFiles):
    kind = executor_kind(config)
    if kind == "fake":  # load and fault tests: deterministic tokens, no weights
        from ultrafast.executors.fake_exec import FakeExecutor

        return FakeExecutor.for_tokenizer(
            files.tokenizer_dir / "tokenizer.json",
            num_slots=config.num_slots,
            max_model_len=config.max_model_len,
            step_s=config.fake_step_s,
        )
    if kind == "ggml":
        from ultrafast.executors.ggml_exec import GgmlExecutor

        gguf_path, args = ggml_executor_args(config, files)  # also what serve opens early
        executor_class: type[GgmlExecutor] = GgmlExecutor
        wide: dict[str, Any] = {}
        if config.wide_pass != "off":  # imports torch: only when asked for
            from ultrafast.executors.wide_exec import WideGgmlExecutor

            executor_class = WideGgmlExecutor
            wide = {"wide_pass": config.wide_pass, "by_need": True}  # executors/wide_lazy.py
        return executor_class(gguf_path, **args, **wide)
    from ultrafast.executors.torch_exec import TorchExecutor

    return TorchExecutor(
        torch_weights(files),
        num_slots=config.num_slots,
        max_model_len=config.max_model_len,
        device=config.device,
        dtype=config.dtype,
        compile=config.compile,
        n_threads=config.n_threads,
    )


def torch_weights(files: ModelFiles) -> Path:
    """What the torch executor loads: a .gguf the user named (dequantized, so both executors
    serve the same file), else the HF directory, else the directory's GGUF."""
    if files.gguf_path is not None and (files.gguf_named or files.hf_dir is None):
        return files.gguf_path
    if files.hf_dir is None:
        raise ValueError("the torch executor needs an HF directory or a GGUF file")
    return files.hf_dir


def build_engine(
    config: EngineConfig,
    priority_itl_target_s: float | None = None,
    default_itl_target_s: float | None = None,
    defer_grammar: bool = False,
) -> tuple[EngineCore, Tokenizer, ModelFiles]:
    """`defer_grammar`: the grammar runtime is built by the engine when it is first idle, or
    on first use (the server: grammar/deferred.py)."""
    # sized by `serve`'s early open of the llama.cpp model when it was given this config
    config, files = early_open.sized_for(config) or sized(config)
    tokenizer = load_tokenizer(files, config.chat_template)
    executor = build_executor(config, files)
    try:
        speculator = build_speculator(config, files)
    except BaseException:
        executor.close()
        raise
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_prefill_chunk_tokens=config.prefill_chunk_tokens,
        max_model_len=config.max_model_len,
        max_waiting=config.max_waiting,
        short_first_window_s=config.short_first_window_s,
    )
    core = EngineCore(
        executor,
        scheduler_config,
        priority_itl_target_s,
        speculator=speculator,
        kv_cache=kv_cache_config(config),
        default_itl_target_s=default_itl_target_s,
        grammar=build_grammar(tokenizer, executor.vocab_size, defer_grammar),
    )
    return core, tokenizer, files


def build_embedding_engine(model: str, n_threads: int | None = None):
    """An embedding model's engine (engine/embed_engine.py), its thread started."""
    from ultrafast.engine.embed_engine import EmbeddingEngine
    from ultrafast.executors.embed_choice import open_embedding_executor

    return EmbeddingEngine(open_embedding_executor(model, n_threads=n_threads))


def kv_cache_config(config: EngineConfig) -> KVCacheConfig:
    return KVCacheConfig(
        host_bytes=int(config.kv_host_cache_gb * (1 << 30)),
        disk_dir=config.kv_disk_dir,
        disk_bytes=int(config.kv_disk_gb * (1 << 30)),
        redis_url=config.kv_store,
        secret_file=config.kv_secret_file,
        redis_ca_file=config.kv_redis_ca_file,
    )


def build_grammar(tokenizer: Tokenizer, vocab_size: int, deferred: bool = False):
    """Constrained decoding for this vocabulary, or None (with a warning) when llguidance
    cannot use it: the server then refuses response_format as unsupported. `deferred`: built
    later, on its first use or at `start()` (grammar/deferred.py: the server's first answer
    does not wait for it)."""
    from ultrafast.grammar.matcher import GrammarRuntime
    from ultrafast.grammar.tokenizer import GrammarUnavailable

    if deferred and tokenizer.eos_token_ids:  # (without, it is unavailable: said at once)
        from ultrafast.grammar.deferred import DeferredGrammarRuntime

        deferred_runtime = DeferredGrammarRuntime(
            lambda: GrammarRuntime.for_tokenizer(tokenizer, vocab_size)
        )
        return cast(GrammarRuntime, deferred_runtime)  # its interface, built on first use
    try:
        return GrammarRuntime.for_tokenizer(tokenizer, vocab_size)
    except GrammarUnavailable as exc:
        log.warning("constrained decoding is off: %s", exc)
        return None


def _draft_files(config: EngineConfig, files: ModelFiles) -> ModelFiles | None:
    """The draft model's files (--draft-model, else the bundled demo draft) when it uses the
    target's tokenizer. A draft with another vocabulary would only propose garbage: with
    `--speculation draft` that is an error at start; with `auto` a warning, and n-gram drafts
    alone."""
    draft = resolve_model(config.draft_model or str(DEMO_DRAFT_DIR))
    if tokenizer_fingerprint(draft) == tokenizer_fingerprint(files):
        return draft
    mismatch = f"draft model {draft.name} does not use the tokenizer of {files.name}"
    if config.speculation == "draft":
        raise ValueError(f"{mismatch}: --speculation draft needs a --draft-model that does")
    log.warning("%s: it does not draft (speculation: n-gram and predicted outputs)", mismatch)
    return None


def build_speculator(config: EngineConfig, files: ModelFiles) -> Speculator:
    """Speculative decoding as configured; `off` still honours a request's `prediction`."""
    draft_model = None
    if config.speculation in ("draft", "auto"):
        draft_files = _draft_files(config, files)
        if draft_files is not None:  # same executor kind, slots and lengths as the target
            # (a draft model is small and its passes narrow: no wide path, no calibration)
            draft_config = replace(config, wide_pass="off")
            draft_model = DraftModelProposer(build_executor(draft_config, draft_files))
    speculation = SpeculationConfig(
        method=config.speculation,
        tiers=tuple(ServiceTier.parse(t) for t in config.speculation_tiers),
        max_draft_tokens=config.max_draft_tokens,
        use_measured_costs=config.speculation_measured_costs,
    )
    return Speculator(speculation, draft_model)


@dataclass
class GenerationOutput:
    """A generation's result in the offline API (LLM.generate), one per prompt."""

    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        if not model:  # the default: SmolLM2 once fetched, else demo-code (with a warning)
            choice = default_model_choice()
            if choice.fallback_notice:
                log.warning("%s", choice.fallback_notice)
            model = choice.path
        self.config = EngineConfig(model=model, **engine_options)
        self.engine, self.tokenizer, self.files = build_engine(self.config)
        self._ids = itertools.count()

    def _request(
        self, prompt: str | list[int], params: SamplingParams, tier: ServiceTier
    ) -> Request:
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        return Request(
            f"offline-{next(self._ids)}",
            list(ids),
            params,
            tier=tier,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | None = None,
        stop: list[str] | None = None,
        tier: ServiceTier = ServiceTier.DEFAULT,
    ) -> list[GenerationOutput]:
        """Generate for every prompt, batched by the scheduler. Output order = prompt order."""
        params = params or SamplingParams()
        requests = [self._request(p, params, tier) for p in _prompt_batch(prompts)]
        stops = {r.request_id: StopStringMatcher(stop or []) for r in requests}
        detoks = {r.request_id: self.tokenizer.detokenizer(r.prompt_token_ids) for r in requests}
        texts = {r.request_id: "" for r in requests}
        finish: dict[str, str] = {}
        for r in requests:
            self.engine.add_request(r)
        while self.engine.has_work():
            for out in self.engine.step():
                rid = out.request_id
                if rid in finish:
                    continue
                delta = detoks[rid].push(out.new_token_ids)
                if out.finished:
                    delta += detoks[rid].flush()
                emitted, stopped = stops[rid].push(delta)
                texts[rid] += emitted
                if stopped:
                    finish[rid] = "stop"
                    self.engine.abort(rid)
                elif out.finished:
                    texts[rid] += stops[rid].flush()
                    finish[rid] = out.finish_reason or "stop"
        return [
            GenerationOutput(
                r.prompt_token_ids,
                texts[r.request_id],
                r.output_token_ids,
                finish.get(r.request_id),
                r.output_logprobs,
                r.num_cached_tokens,
            )
            for r in requests
        ]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield text deltas of one prompt (a text or its token ids) as they are generated."""
        request = self._request(prompt, params or SamplingParams(), ServiceTier.PRIORITY)
        detok = self.tokenizer.detokenizer(request.prompt_token_ids)
        self.engine.add_request(request)
        done = False
        try:
            while self.engine.has_work():
                for out in self.engine.step():
                    if out.request_id == request.request_id:
                        done = out.finished
                        delta = detok.push(out.new_token_ids)
                        if out.finished:
                            delta += detok.flush()
                        if delta:
                            yield delta
        finally:
            if not done:  # the caller stopped reading: free the slot
                self.engine.abort(request.request_id)
                while self.engine.has_work():
                    self.engine.step()

    def close(self) -> None:
        self.engine.close()  # the tiered KV cache's pending writes, then the executor
        if self.engine.speculator is not None:
            self.engine.speculator.close()


def _is_token_ids(prompts: list[int] | list[str] | list[list[int]]) -> TypeGuard[list[int]]:
    return bool(prompts) and isinstance(prompts[0], int)


def _prompt_batch(
    prompts: str | list[int] | list[str] | list[list[int]],
) -> list[str | list[int]]:
    """One prompt (a text or its token ids) or a list of prompts, as a list of prompts."""
    if isinstance(prompts, str) or _is_token_ids(prompts):
        return [prompts]
    batch: list[str | list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, int):
            raise TypeError("a list of prompts holds texts or token-id lists, not bare ids")
        batch.append(prompt)
    return batch
