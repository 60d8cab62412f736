"""Batch-1 decode speed, side by side in one process: our engine vs llama.cpp vs transformers.

Every runner gets the same prompt ids, generates the same number of tokens greedily with EOS
ignored, on the same threads. Runners are interleaved over several rounds and the median is
reported, so drift on a shared machine hits all of them alike. Decode speed excludes the
prefill (time from first to last token).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ultrafast.model_files import gguf_for, load_tokenizer, resolve_model
from ultrafast.progress import Progress
from ultrafast_harness.bench.report import write_report
from ultrafast_harness.bench.suite_args import (
    add_model,
    add_new_tokens,
    add_out,
    add_rounds,
    add_threads,
    fraction,
)

if TYPE_CHECKING:  # the engine brings torch: imported only when our runner is built
    from ultrafast.engine.core import EngineCore
    from ultrafast.engine.speculation import SpeculationStats


@dataclass
class RunResult:
    name: str
    decode_tok_s: float  # (new_tokens - 1) / (t_last - t_first)
    ttft_ms: float  # prompt to first token
    acceptance: float | None = None  # speculative runners: accepted / drafted tokens
    matches_plain: bool | None = None  # prediction runner: its greedy tokens == plain greedy


# a runner: run() -> (time to first token, first-to-last token time) in seconds, and close()
Runner = tuple[Callable[[], tuple[float, float]], Callable[[], None]]


@dataclass
class _EngineRound:
    """Our engine's timed round; the report reads `speculation_stats`, scripts look inside
    `engine`."""

    timed_round: Callable[[], tuple[float, float]]
    engine: EngineCore
    speculation_stats: SpeculationStats | None
    output_ids: list[int]  # the last round's generated tokens

    def __call__(self) -> tuple[float, float]:
        return self.timed_round()


def _round_times(start: float, first: float | None, last: float | None) -> tuple[float, float]:
    if first is None or last is None:
        raise RuntimeError("the runner generated no token")
    return first - start, last - first


def _ours(
    files, gguf, prompt_ids, num_new, threads, executor_kind, speculation="off", prediction=None
) -> Runner:
    """Our engine; with `speculation` other than off, a priority request with speculative decoding;
    with `prediction`, a default-tier request whose only drafts are these predicted tokens."""
    from ultrafast.config import EngineConfig
    from ultrafast.llm import build_engine
    from ultrafast.request import Request, SamplingParams, ServiceTier

    # the torch executor loads a GGUF dequantized when the model has no HF directory
    model = gguf if executor_kind == "ggml" or files.hf_dir is None else files.hf_dir
    config = EngineConfig(
        model=str(model),
        executor=executor_kind,
        num_slots=1,
        max_num_seqs=1,
        max_model_len=len(prompt_ids) + num_new + 8,
        n_threads=threads,
        # a prediction needs the speculator, but the default tier keeps n-gram drafts off
        speculation="ngram" if prediction is not None else speculation,
    )
    engine, tokenizer, _ = build_engine(config)
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    tier = ServiceTier.PRIORITY if speculation != "off" else ServiceTier.DEFAULT
    counter = [0]
    output_ids: list[int] = []

    def run() -> tuple[float, float]:
        counter[0] += 1
        engine.pool.reset_cache()  # each round prefills from scratch, like the peers
        output_ids.clear()
        start = time.perf_counter()
        engine.add_request(
            Request(
                f"bench-{counter[0]}",
                list(prompt_ids),
                params,
                tier=tier,
                prediction_token_ids=list(prediction or []),
            )
        )
        first: float | None = None
        last: float | None = None
        while engine.has_work():
            for out in engine.step():
                if out.new_token_ids:
                    last = time.perf_counter()
                    first = first or last
                    output_ids.extend(out.new_token_ids)
        return _round_times(start, first, last)

    def close() -> None:
        engine.executor.close()
        if engine.speculator is not None:
            engine.speculator.close()

    drafts = speculation != "off" or prediction is not None
    return _EngineRound(
        run, engine, engine.speculation_stats if drafts else None, output_ids
    ), close


def _plain_greedy(files, gguf, prompt_ids, num_new, threads) -> list[int]:
    """Our plain ggml runner's greedy output, once and untimed: the prediction's source."""
    run, close = _ours(files, gguf, prompt_ids, num_new, threads, "ggml")
    try:
        run()
        return list(run.output_ids)  # type: ignore[attr-defined]
    finally:
        close()


def edit_prediction(
    tokens: list[int], edit_rate: float, seed: int = 0, alphabet: list[int] | None = None
) -> list[int]:
    """`tokens` with round(edit_rate * len) seeded positions replaced by another token from
    `alphabet` (default: the tokens' own), so most of the prediction survives, as when a
    client edits a file."""
    if not 0.0 <= edit_rate <= 1.0:
        raise ValueError("the prediction edit rate must be in [0, 1]")
    rng = random.Random(seed)
    edited = list(tokens)
    alphabet = sorted(set(alphabet or tokens))
    for pos in rng.sample(range(len(tokens)), round(edit_rate * len(tokens))):
        others = [t for t in alphabet if t != tokens[pos]]
        if others:
            edited[pos] = rng.choice(others)
    return edited


def _llama_cpp(gguf, prompt_ids, num_new, threads) -> Runner:
    from ultrafast.executors.llama_cpp_params import open_llama

    llm = open_llama(
        str(gguf),
        n_ctx=len(prompt_ids) + num_new + 8,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
        logits_all=False,
    )

    def run() -> tuple[float, float]:
        llm.reset()
        start = time.perf_counter()
        first: float | None = None
        last: float | None = None
        n = 0
        for _ in llm.generate(list(prompt_ids), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            last = time.perf_counter()
            first = first or last
            n += 1
            if n >= num_new:
                break
        return _round_times(start, first, last)

    return run, llm.close


def _transformers(hf_dir, prompt_ids, num_new, threads) -> Runner:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])

    def generate(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def run() -> tuple[float, float]:
        ttft = generate(1)
        return ttft, generate(num_new) - ttft

    return run, lambda: None


SPECULATION_VARIANTS = ("ngram", "draft", "auto", "prediction")
PREDICTION_SEED = 0


def run_decode_bench(
    model: str,
    num_new: int = 128,
    prompt_tokens: int = 32,
    rounds: int = 3,
    threads: int | None = None,
    peers: tuple[str, ...] = ("ultrafast-ggml", "llama.cpp", "ultrafast-torch", "transformers"),
    gguf_type: str = "f16",
    gguf_paths: list[str] | None = None,
    speculation: tuple[str, ...] = (),
    prediction_edit_rate: float = 0.1,
) -> dict:
    """gguf_paths: compare these GGUF files instead (our ggml executor, plain and with each
    `speculation` method, and llama.cpp on each file, runners named `...[file stem]`; transformers
    fp32 stays as the common reference).
    `speculation`: speculative variants of the ggml runner (ngram, draft, auto) run alongside;
    `prediction` runs it with predicted outputs: the plain greedy output of the same file
    with `prediction_edit_rate` of its tokens replaced (seeded)."""
    import os

    unknown = sorted(set(speculation) - set(SPECULATION_VARIANTS))
    if unknown:
        raise ValueError(f"unknown --speculation {unknown}: use {', '.join(SPECULATION_VARIANTS)}")
    if not 0.0 <= prediction_edit_rate <= 1.0:
        raise ValueError("--prediction-edit-rate must be in [0, 1]")
    threads = threads or len(os.sched_getaffinity(0))
    files = resolve_model(model)
    gguf = gguf_for(files, gguf_type)
    tokenizer = load_tokenizer(files)
    text = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
    prompt_ids = (tokenizer.encode(text) * 8)[:prompt_tokens]
    notes: list[str] = []
    plain_outputs: dict[str, list[int]] = {}  # runner name -> the plain greedy tokens

    def speculative_runner(path, method: str, name: str) -> Callable[[], Runner]:
        if method != "prediction":
            return partial(_ours, files, path, prompt_ids, num_new, threads, "ggml", method)

        def make() -> Runner:
            plain = _plain_greedy(files, path, prompt_ids, num_new, threads)
            plain_outputs[name] = plain
            predicted = edit_prediction(
                plain, prediction_edit_rate, PREDICTION_SEED, alphabet=prompt_ids + plain
            )
            return _ours(files, path, prompt_ids, num_new, threads, "ggml", prediction=predicted)

        return make

    makers: dict[str, Callable[[], Runner]] = {
        "ultrafast-ggml": lambda: _ours(files, gguf, prompt_ids, num_new, threads, "ggml"),
        "ultrafast-torch": lambda: _ours(files, gguf, prompt_ids, num_new, threads, "torch"),
        "llama.cpp": lambda: _llama_cpp(gguf, prompt_ids, num_new, threads),
        "transformers": lambda: _transformers(files.hf_dir, prompt_ids, num_new, threads),
    }
    extra_peers = [f"ultrafast-ggml-spec-{m}" for m in speculation]
    for method in speculation:
        name = f"ultrafast-ggml-spec-{method}"
        makers[name] = speculative_runner(gguf, method, name)
    if gguf_paths:  # per file: ours plain and speculative vs llama.cpp; transformers fp32 once
        extra_peers = []
        for path in gguf_paths:
            stem = Path(path).stem
            makers[f"ultrafast-ggml[{stem}]"] = partial(
                _ours, files, path, prompt_ids, num_new, threads, "ggml"
            )
            makers[f"llama.cpp[{stem}]"] = partial(_llama_cpp, path, prompt_ids, num_new, threads)
            for method in speculation:
                name = f"ultrafast-ggml-spec-{method}[{stem}]"
                makers[name] = speculative_runner(path, method, name)
            extra_peers += [
                f"ultrafast-ggml[{stem}]",
                f"llama.cpp[{stem}]",
                *(f"ultrafast-ggml-spec-{m}[{stem}]" for m in speculation),
            ]
        peers = ("transformers",) if "transformers" in peers else ()
        gguf = Path(gguf_paths[0])
    if files.hf_dir is None and "transformers" in peers:
        peers = tuple(p for p in peers if p != "transformers")
        notes.append("transformers skipped: the model is a GGUF without an HF directory")
    peers = tuple(peers) + tuple(extra_peers)
    runners = {name: makers[name]() for name in peers}
    progress = Progress("bench decode", total=(rounds + 1) * len(runners), unit="runs")
    for name, (run, _) in runners.items():
        run()  # warm-up
        progress.update(runner=name)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in peers}
    for _ in range(rounds):
        for name, (run, _) in runners.items():
            samples[name].append(run())
            progress.update(runner=name)
    progress.close()
    for _, close in runners.values():
        close()
    results = {}
    for name, runs in samples.items():
        decode_s = statistics.median(d for _, d in runs)
        stats = getattr(runners[name][0], "speculation_stats", None)
        plain = plain_outputs.get(name)
        results[name] = asdict(
            RunResult(
                name,
                (num_new - 1) / decode_s,
                1000 * statistics.median(t for t, _ in runs),
                stats.acceptance_rate() if stats else None,
                None if plain is None else runners[name][0].output_ids == plain,  # type: ignore[attr-defined]
            )
        )
    report = {
        "model": files.name,
        "gguf": gguf.name,
        "threads": threads,
        "new_tokens": num_new,
        "prompt_tokens": len(prompt_ids),
        "rounds": rounds,
        "results": results,
        "notes": notes,
    }
    if "prediction" in speculation:
        report["prediction"] = {"edit_rate": prediction_edit_rate, "seed": PREDICTION_SEED}
    return report


def markdown(report: dict) -> str:
    res = report["results"]
    lines = [
        f"model `{report['model']}` ({report['gguf']}), batch 1, {report['prompt_tokens']} "
        f"prompt tokens, {report['new_tokens']} new tokens, {report['threads']} threads, "
        f"median of {report['rounds']} interleaved rounds",
        "",
        "| runner | decode tok/s | TTFT ms | vs llama.cpp | vs transformers | accepted |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        peer = "llama.cpp" + name[name.index("[") :] if "[" in name else "llama.cpp"
        vs_llama = _ratio(r, res.get(peer))  # "-": no llama.cpp run of the same file
        vs_hf = _ratio(r, res.get("transformers"))
        accepted = "" if r.get("acceptance") is None else f"{r['acceptance']:.0%}"
        lines.append(
            f"| {name} | {r['decode_tok_s']:.1f} | {r['ttft_ms']:.1f} | "
            f"{vs_llama} | {vs_hf} | {accepted} |"
        )
    prediction = report.get("prediction")
    if prediction:
        same = [r["matches_plain"] for r in res.values() if r.get("matches_plain") is not None]
        lines += [
            "",
            f"spec-prediction: the request's prediction is the plain greedy output of the same "
            f"prompt and file ({report['new_tokens']} tokens, computed once, untimed) with "
            f"{prediction['edit_rate']:.0%} of its tokens replaced (seed {prediction['seed']}), "
            f"an editing workload; its output "
            + ("equals plain greedy" if all(same) else "DIFFERS from plain greedy"),
        ]
    lines += ["", *report.get("notes", [])] if report.get("notes") else []
    return "\n".join(lines)


def _ratio(result: dict, peer: dict | None) -> str:
    return "-" if peer is None else f"{result['decode_tok_s'] / peer['decode_tok_s']:.2f}x"


def main(args) -> int:
    speculation = tuple(m.strip() for m in (args.speculation or "").split(",") if m.strip())
    report = run_decode_bench(
        args.model,
        num_new=args.new_tokens,
        rounds=args.rounds,
        threads=args.threads,
        gguf_type=args.gguf_type,
        gguf_paths=args.gguf,
        speculation=speculation,
        prediction_edit_rate=args.prediction_edit_rate,
    )
    return write_report(report, args.out, markdown(report))


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench decode --help`)."""
    add_model(p, "HF model directory or .gguf file (a GGUF alone skips transformers)")
    add_new_tokens(p, "tokens decoded per round")
    add_rounds(p, 3)
    add_threads(p, "kernel threads (default: all cores)")
    p.add_argument("--gguf-type", default="f16", help="GGUF type for both ggml runners")
    p.add_argument(
        "--gguf",
        action="append",
        default=None,
        metavar="PATH",
        help="compare these GGUF files instead (repeatable), ours vs llama.cpp on "
        "each, e.g. f16 vs q8_0 vs hybrid",
    )
    p.add_argument(
        "--speculation",
        "--spec",
        default="ngram,draft",
        help="speculative variants of our ggml runner to add, comma-separated from "
        "ngram, draft, auto, prediction (empty: none; default ngram,draft); prediction: "
        "predicted outputs made from the plain greedy output, see --prediction-edit-rate",
    )
    p.add_argument(
        "--prediction-edit-rate",
        type=fraction,
        default=0.1,
        metavar="RATE",
        help="fraction of the plain greedy tokens replaced (seeded) to make the prediction "
        "of --speculation prediction (default 0.1)",
    )
    add_out(p, "runs/bench_decode.json")
