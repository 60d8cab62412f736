"""llama.cpp's own prefill of new tokens after a long cached history vs fresh, with the KV
cache and attention variants llama.cpp offers: is there a faster attention for long
conversations on this CPU?

    .venv/bin/python scripts/attention_variants.py [GGUF] [THREADS]

Prints, per variant, the time to evaluate 60 fresh tokens and 70 new tokens after 1,800 cached
ones (what a conversation's turn 1 and turn 20 prefill), and their ratio.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrafast_harness.bench.server_process import DEMO_MODEL_DIR  # noqa: E402
from ultrafast_harness.bench.sessions import llama_cpp_floor  # noqa: E402

GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8
VARIANTS = {
    "f16 KV": {},
    "f16 KV + flash attention": {"flash_attn": True},
    "f32 KV + flash attention": {"flash_attn": True, "type_k": GGML_F32, "type_v": GGML_F32},
    "q8_0 KV + flash attention": {"flash_attn": True, "type_k": GGML_Q8_0, "type_v": GGML_Q8_0},
}


def main() -> None:
    gguf = sys.argv[1] if len(sys.argv) > 1 else str(DEMO_MODEL_DIR / "demo-code-f16.gguf")
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    for name, kwargs in VARIANTS.items():
        t = llama_cpp_floor(gguf, threads, {"fresh": (0, 60), "after": (1800, 70)}, **kwargs)
        print(
            f"{name:26s} 60 fresh {1e3 * t['fresh']:8.1f} ms, 70 after 1,800 "
            f"{1e3 * t['after']:8.1f} ms, ratio {t['after'] / t['fresh']:.2f}"
        )


if __name__ == "__main__":
    main()
