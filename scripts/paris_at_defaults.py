"""Issue 32's first question at the default model's recommended sampling, ours beside llama.cpp.

"What is the capital of France?" (no system message: the template's default one), temperature
0.2, top_p 0.9 (SmolLM2's card), seeds 0..N-1, at most --max-tokens tokens: how many answers
name Paris in a sentence and stop. Ours: the offline engine (the server's sampler and template);
llama.cpp: llama-cpp-python's high-level API (`open_llama`, as the benchmarks open it; its own
template from the GGUF and sampler chain, top_k off, min_p off, no repeat penalty) on the same
file. `--system` leads with a one-line system message.

    python scripts/paris_at_defaults.py [--seeds 10] [--max-tokens 128] [--threads 1] [--system]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrafast.config import smollm2_gguf  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = {"role": "system", "content": "Answer in one short sentence."}


def messages(args) -> list[dict]:
    return [SYSTEM, *QUESTION] if args.system else QUESTION


def good(text: str, finish: str | None) -> bool:
    return finish == "stop" and "Paris" in text and len(text.split()) >= 4


def ours(path: Path, args) -> list[tuple[str, str | None]]:
    from ultrafast.llm import LLM
    from ultrafast.request import SamplingParams

    llm = LLM(str(path), num_slots=1, n_threads=args.threads, n_threads_batch=args.threads)
    prompt = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(messages(args)), add_special_tokens=False
    )
    out = []
    for seed in range(args.seeds):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.2, top_p=0.9, seed=seed)
        done = llm.generate([prompt], params)[0]
        out.append((done.text, done.finish_reason))
    llm.close()
    return out


def llama_cpp(path: Path, args) -> list[tuple[str, str | None]]:
    from ultrafast.executors.llama_cpp_params import open_llama

    # as the benchmark peers open it: without the AMX weight buffers that crash on this CPU
    llm = open_llama(str(path), n_ctx=2048, n_threads=args.threads, verbose=False)
    out = []
    for seed in range(args.seeds):
        llm.set_seed(seed)
        done = llm.create_chat_completion(
            messages(args),
            temperature=0.2,
            top_p=0.9,
            top_k=0,
            min_p=0.0,
            repeat_penalty=1.0,
            max_tokens=args.max_tokens,
            seed=seed,
        )
        choice = done["choices"][0]
        out.append((choice["message"]["content"] or "", choice["finish_reason"]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--system", action="store_true", help="lead with " + repr(SYSTEM["content"])
    )
    parser.add_argument("--only", choices=["ours", "llama.cpp"], default=None)
    args = parser.parse_args()
    path = smollm2_gguf()
    for name, run in (("ours", ours), ("llama.cpp", llama_cpp)):
        if args.only and args.only != name:
            continue
        answers = run(path, args)
        hits = sum(good(text, finish) for text, finish in answers)
        print(f"{name}: {hits}/{len(answers)} name Paris in a sentence and stop", flush=True)
        for seed, (text, finish) in enumerate(answers):
            print(f"  seed {seed} [{finish}] {text[:100]!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
