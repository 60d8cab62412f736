"""How many constrained answers run to max_tokens (and so are not JSON) on ordinary schemas.

Each schema of `tests/data/ordinary_schemas.json` (50 schemas as clients write them: dates,
prices, coordinates, IDs, enums, nested objects, arrays, most without size bounds) is asked
for once per temperature, through the model's chat template, with `max_tokens` 384, batched
on one engine. Counts answers that ended `length`, ended `stop` with valid JSON, ended `stop`
invalid (a grammar bug), and schemas refused before generating (the compile or the schema
check). A count, not a timing: a loaded machine gives the same figures (greedy exactly; the
sampled run is seeded per schema).

Runs on any commit that has `GrammarSpec.from_json_schema` and `LLM` (for a before/after:
`git worktree add /tmp/before f699dec` and `PYTHONPATH=/tmp/before python
scripts/grammar_length_share.py MODEL`).

    python scripts/grammar_length_share.py [MODEL] [--max-tokens 384] [--temperatures 0,1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.grammar import GrammarSpec
from ultrafast.llm import LLM
from ultrafast.request import Request, SamplingParams

SCHEMAS = Path(__file__).resolve().parents[1] / "tests" / "data" / "ordinary_schemas.json"


def prompt_ids(llm: LLM, ask: str) -> list[int]:
    text = f"Give {ask} as JSON."
    try:
        return llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]), False
        )
    except Exception:  # no chat template (the demo model): a plain prompt
        return llm.tokenizer.encode(text + "\n")


def submit(llm: LLM, cases: list[dict], temperatures: list[float], max_tokens: int):
    """Requests for every (schema, temperature); the refused schemas' names."""
    requests, refused = {}, []
    for i, case in enumerate(cases):
        try:
            spec = GrammarSpec.from_json_schema(case["schema"], strict=True)
            llm.engine.grammar.compile(spec)
        except Exception as exc:  # a SchemaProblem, a GrammarError: refused up front
            refused.append(f"{case['name']}: {str(exc)[:120]}")
            continue
        for temperature in temperatures:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=i, grammar=spec
            )
            rid = f"{case['name']}@{temperature}"
            ids = prompt_ids(llm, case["ask"])
            requests[rid] = Request(rid, ids, params, eos_token_ids=llm.tokenizer.eos_token_ids)
            llm.engine.add_request(requests[rid])
    return requests, refused


def run(model: str, max_tokens: int, temperatures: list[float], limit_s: float) -> dict:
    cases = json.loads(SCHEMAS.read_text())
    width = min(64, len(cases) * len(temperatures))  # all at once: fewest steps
    llm = LLM(model, speculation="off", num_slots=width, max_num_seqs=width, max_model_len=1024)
    try:
        requests, refused = submit(llm, cases, temperatures, max_tokens)
        out: dict[str, list[int]] = {rid: [] for rid in requests}
        finish: dict[str, str] = {}
        steps, start = 0, time.monotonic()
        while llm.engine.has_work() and time.monotonic() - start < limit_s:
            for o in llm.engine.step():
                out[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    finish[o.request_id] = o.finish_reason
            steps += 1
            if steps % 64 == 0:
                print(f"step {steps}: {len(finish)}/{len(out)} done", file=sys.stderr, flush=True)
    finally:
        llm.close()
    schemas = {c["name"]: c["schema"] for c in cases}
    counts = {"answers": len(requests), "length": 0, "stop_valid": 0, "stop_invalid": 0}
    counts["unfinished"] = len(requests) - len(finish)  # still generating at the time limit
    cut = []
    for rid, ids in out.items():
        text = llm.tokenizer.decode(ids)
        if rid not in finish:
            cut.append(f"{rid} UNFINISHED after {len(ids)} tokens")
            continue
        if finish[rid] != "stop":
            counts["length"] += 1
            cut.append(f"{rid}: ...{text[-60:]!r}")
            continue
        try:
            jsonschema.validate(json.loads(text), schemas[rid.split("@")[0]])
            counts["stop_valid"] += 1
        except (ValueError, jsonschema.ValidationError):
            counts["stop_invalid"] += 1
            cut.append(f"{rid} INVALID: {text[-80:]!r}")
    share = counts["length"] / max(counts["answers"], 1)
    return {"model": model, **counts, "length_share": round(share, 3), "refused": refused,
            "cut": cut}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=str(DEMO_MODEL_DIR))
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument(
        "--time-limit-s", type=float, default=float("inf"), help="stop stepping after this"
    )
    args = ap.parse_args()
    temps = [float(t) for t in args.temperatures.split(",")]
    print(json.dumps(run(args.model, args.max_tokens, temps, args.time_limit_s), indent=1))


if __name__ == "__main__":
    main()
