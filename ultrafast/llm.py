"""Offline API: `LLM(model).generate(prompts, params)`, and the factory that builds an engine.

Same engine core as the server, driven synchronously on the caller's thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Iterator

from ultrafast.config import EngineConfig, default_model
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.core.types import TokenLogprobs
from ultrafast.model_files import ModelFiles, gguf_for, resolve_model
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.runtime.engine import EngineCore
from ultrafast.tokenizer import StopStringMatcher, Tokenizer


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def build_executor(config: EngineConfig, files: ModelFiles):
    kind = config.executor
    if kind == "auto":
        kind = "torch" if _cuda_available() else "ggml"
    if kind == "ggml":
        from ultrafast.executors.ggml_exec import GgmlExecutor

        return GgmlExecutor(gguf_for(files, config.gguf_type), num_slots=config.num_slots,
                            max_model_len=config.max_model_len, n_threads=config.n_threads,
                            max_num_batched_tokens=config.max_num_batched_tokens)
    if files.hf_dir is None:
        raise ValueError("the torch executor needs an HF directory (config.json + safetensors)")
    from ultrafast.executors.torch_exec import TorchExecutor

    return TorchExecutor(files.hf_dir, num_slots=config.num_slots,
                         max_model_len=config.max_model_len, device=config.device,
                         dtype=config.dtype, compile=config.compile)


def build_engine(config: EngineConfig, priority_itl_target_s: float | None = None
                 ) -> tuple[EngineCore, Tokenizer, ModelFiles]:
    files = resolve_model(config.model)
    if files.max_position_embeddings:
        config = replace(config, max_model_len=min(config.max_model_len,
                                                   files.max_position_embeddings))
    tokenizer = Tokenizer.from_dir(files.tokenizer_dir)
    executor = build_executor(config, files)
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_prefill_chunk_tokens=config.max_prefill_chunk_tokens,
        max_model_len=config.max_model_len, max_waiting=config.max_waiting)
    return EngineCore(executor, scheduler_config, priority_itl_target_s), tokenizer, files


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        self.config = EngineConfig(model=model or default_model(), **engine_options)
        self.engine, self.tokenizer, self.files = build_engine(self.config)
        self._ids = itertools.count()

    def _request(self, prompt: str | list[int], params: SamplingParams,
                 tier: ServiceTier) -> Request:
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        return Request(f"offline-{next(self._ids)}", list(ids), params, tier=tier,
                       eos_token_ids=self.tokenizer.eos_token_ids)

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | None = None, stop: list[str] | None = None,
                 tier: ServiceTier = ServiceTier.DEFAULT) -> list[GenerationOutput]:
        """Generate for every prompt, batched by the scheduler. Output order = prompt order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        requests = [self._request(p, params, tier) for p in prompts]
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
        return [GenerationOutput(r.prompt_token_ids, texts[r.request_id], r.output_token_ids,
                                 finish.get(r.request_id), r.output_logprobs, r.num_cached_tokens)
                for r in requests]

    def stream(self, prompt: str, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt as they are generated."""
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
        self.engine.executor.close()
