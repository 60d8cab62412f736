"""First n-gram lookup of a long conversation's turn: a fresh index vs the previous turn's,
taken over (engine/speculation.py). The lookup runs before the turn's second token.

    .venv/bin/python scripts/ngram_index_time.py [HISTORY_TOKENS]
"""

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrafast.engine.speculation import SpeculationConfig, Speculator  # noqa: E402
from ultrafast.request import Request, SamplingParams, ServiceTier  # noqa: E402


def main() -> None:
    num_history = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    fresh, taken = [], []
    for trial in range(20):
        history = [rng.randrange(32000) for _ in range(num_history)]
        turn = history + [rng.randrange(32000) for _ in range(60)]
        speculator = Speculator(SpeculationConfig(method="ngram"))
        for name, prompt, times in ((f"{trial}-1", history, fresh), (f"{trial}-2", turn, taken)):
            request = Request(name, prompt, params, tier=ServiceTier.PRIORITY)
            speculator.admit(request)
            started = time.perf_counter()
            speculator._state(request).ngram.lookup(8)
            times.append(time.perf_counter() - started)
            speculator.release(name)
    print(
        f"{num_history}-token history, first lookup (median of 20): fresh index "
        f"{1e3 * statistics.median(fresh):.2f} ms, the previous turn's taken over "
        f"{1e3 * statistics.median(taken):.2f} ms"
    )


if __name__ == "__main__":
    main()
