"""The runners `ultrafast bench` drives side by side, each behind one small interface.

`runner.run(prompts, max_tokens) -> Batch`: start one stream per prompt at once (concurrency =
len(prompts)), generate exactly max_tokens greedily with EOS ignored, and stamp every token as
it becomes visible to the caller. What "visible" means per runner:

- ours-engine: an in-process EngineCore stepping on this thread (a token is out when `step()`
  returns it); all prompts are added before the first step.
- ours-server: the real `ultrafast serve` child process, one streaming HTTP request per prompt
  (httpx, asyncio); a token is out when its SSE chunk arrives.
- llama.cpp: llama-cpp-python's own `Llama.generate` loop; it cannot batch, so it runs only at
  concurrency 1 (`max_concurrency`).
- transformers: `generate` on one padded-free batch (all prompts have the same length), with a
  streamer that stamps each step; every row of a step shares the stamp.
- vllm: its offline `LLM.generate` (GPU machines where it is installed); no per-token stamps,
  so only TTFT (from its request metrics, when it reports them) and tokens/s.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Stream:
    """One request's timing, seconds from the moment the batch was started."""

    token_times_s: list[float] = field(default_factory=list)  # one stamp per token (or chunk)
    num_tokens: int = 0  # tokens generated (a chunk may carry several)
    ttft_only_s: float | None = None  # runners without per-token stamps (vllm)

    @property
    def ttft_s(self) -> float | None:
        if self.ttft_only_s is not None:
            return self.ttft_only_s
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def gaps_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class Batch:
    streams: list[Stream]
    wall_s: float  # start of the batch to its last token


class EngineRunner:
    """Our engine in this process (ggml or torch executor)."""

    max_concurrency = None

    def __init__(
        self,
        name: str,
        model: str,
        executor: str,
        num_slots: int,
        max_model_len: int,
        threads: int,
        compile: str = "auto",
    ):
        from ultrafast.config import EngineConfig
        from ultrafast.llm import build_engine

        self.name = name
        config = EngineConfig(
            model=model,
            executor=executor,
            num_slots=num_slots,
            max_num_seqs=num_slots,
            max_model_len=max_model_len,
            n_threads=threads,
            compile=compile,
        )
        self.engine, _, _ = build_engine(config)
        self.engine.warmup()
        self._ids = 0

    def run(self, prompts: list[list[int]], max_tokens: int) -> Batch:
        from ultrafast.request import Request, SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.pool.reset_cache()  # every batch prefills from scratch, like the peers
        streams: dict[str, Stream] = {}
        start = time.perf_counter()
        for prompt in prompts:
            self._ids += 1
            rid = f"bench-{self._ids}"
            streams[rid] = Stream()
            self.engine.add_request(Request(rid, list(prompt), params))
        while self.engine.has_work():
            outputs = self.engine.step()
            now = time.perf_counter() - start
            for out in outputs:
                if out.error:
                    raise RuntimeError(f"{self.name}: {out.error}")
                if out.new_token_ids:
                    s = streams[out.request_id]
                    s.token_times_s.append(now)
                    s.num_tokens += len(out.new_token_ids)
        return Batch(list(streams.values()), time.perf_counter() - start)

    def close(self) -> None:
        self.engine.executor.close()


class ServerRunner:
    """The real server, started here on a free loopback port, driven by streaming clients."""

    max_concurrency = None

    def __init__(
        self,
        name: str,
        model: str,
        executor: str,
        num_slots: int,
        max_model_len: int,
        threads: int,
        compile: str = "auto",
    ):
        from ultrafast_harness.bench.server_process import ServerProcess

        self.name = name
        # default tier with a loose TTFT target: a benchmark wants every stream served and
        # timed, not refused by admission control (which has its own tests and `bench tiers`)
        self.server = ServerProcess(
            "--executor",
            executor,
            "--threads",
            str(threads),
            "--compile",
            compile,
            "--default-ttft-ms",
            "600000",
            model=model,
            num_slots=num_slots,
            max_model_len=max_model_len,
        )

    async def _stream(
        self, client: httpx.AsyncClient, prompt: list[int], max_tokens: int, start: float
    ) -> Stream:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        stream = Stream()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {await r.aread()!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    stream.num_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stream.token_times_s.append(time.perf_counter() - start)
        if not stream.num_tokens:
            stream.num_tokens = len(stream.token_times_s)
        return stream

    async def _run(self, prompts: list[list[int]], max_tokens: int) -> Batch:
        limits = httpx.Limits(max_connections=len(prompts) + 4)
        async with httpx.AsyncClient(
            base_url=self.server.url, timeout=600, limits=limits
        ) as client:
            start = time.perf_counter()
            streams = await asyncio.gather(
                *(self._stream(client, p, max_tokens, start) for p in prompts)
            )
            return Batch(list(streams), time.perf_counter() - start)

    def run(self, prompts: list[list[int]], max_tokens: int) -> Batch:
        return asyncio.run(self._run(prompts, max_tokens))

    def close(self) -> None:
        self.server.stop()


class LlamaCppRunner:
    """llama-cpp-python's own generate loop (no batching: concurrency 1 only)."""

    max_concurrency = 1

    def __init__(self, gguf: str, max_model_len: int, threads: int):
        from ultrafast.executors.llama_cpp_params import open_llama

        self.name = "llama.cpp"
        self.llm = open_llama(
            str(gguf),
            n_ctx=max_model_len,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            verbose=False,
        )

    def run(self, prompts: list[list[int]], max_tokens: int) -> Batch:
        (prompt,) = prompts
        self.llm.reset()
        stream = Stream()
        start = time.perf_counter()
        for _ in self.llm.generate(list(prompt), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            stream.token_times_s.append(time.perf_counter() - start)
            stream.num_tokens += 1
            if stream.num_tokens >= max_tokens:
                break
        return Batch([stream], time.perf_counter() - start)

    def close(self) -> None:
        self.llm.close()


class _StampStreamer:
    """transformers streamer: `put` is called with the prompt, then once per generated step."""

    def __init__(self, start: float):
        self.start = start
        self.stamps_s: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.stamps_s.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass


class TransformersRunner:
    """transformers `generate` (fp32 on CPU; bf16 on CUDA), one static batch per run."""

    max_concurrency = None

    def __init__(self, hf_dir: str, threads: int, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.name = "transformers" if device == "cpu" else f"transformers-{device}"
        if device == "cpu":
            torch.set_num_threads(threads)
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.device = device
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
        # transformers types `.to` through a decorator that drops the bound self
        self.model = model.to(device).eval()  # type: ignore[arg-type]

    def run(self, prompts: list[list[int]], max_tokens: int) -> Batch:
        torch = self.torch
        ids = torch.tensor(prompts, device=self.device)
        start = time.perf_counter()
        streamer = _StampStreamer(start)
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=streamer,
            )
        wall_s = time.perf_counter() - start
        streams = [Stream(list(streamer.stamps_s), len(streamer.stamps_s)) for _ in prompts]
        return Batch(streams, wall_s)

    def close(self) -> None:
        self.model = None


class VllmRunner:
    """vLLM's offline generate, where installed (GPU machines)."""

    max_concurrency = None

    def __init__(self, hf_dir: str, max_model_len: int):
        import vllm

        self.name = "vllm"
        self.vllm = vllm
        self.llm = vllm.LLM(
            model=hf_dir,
            max_model_len=max_model_len,
            enforce_eager=False,
            gpu_memory_utilization=0.3,
        )

    def run(self, prompts: list[list[int]], max_tokens: int) -> Batch:
        params = self.vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        wall_s = time.perf_counter() - start
        streams = []
        for out in outputs:
            metrics = getattr(out, "metrics", None)
            first = getattr(metrics, "first_token_time", None)
            arrival = getattr(metrics, "arrival_time", None)
            ttft = (first - arrival) if first and arrival else None
            streams.append(Stream([], len(out.outputs[0].token_ids), ttft_only_s=ttft))
        return Batch(streams, wall_s)

    def close(self) -> None:
        self.llm = None
