"""Train the bundled demo models from scratch: a byte-level BPE tokenizer, a ~11M-parameter
Llama-architecture code model and a ~1M-parameter draft model, on this machine's Python stdlib.

There are no pretrained weights to download here, so the project makes its own. Training stops
on wall-clock time (--main-minutes / --draft-minutes), not on a step count, so it fits the
session on any machine; the log says how many tokens each model saw.

    .venv/bin/python scripts/train_demo_models.py --out models
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ultrafast.corpus import stdlib_split
from ultrafast.progress import Progress

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAIN_SHAPE = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
)
DRAFT_SHAPE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def corpus_files() -> tuple[list[Path], list[Path]]:
    """stdlib .py files, split by a hash of the relative path (about 2% held out)."""
    return stdlib_split()


def read(paths: list[Path]) -> list[str]:
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_all(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def make_model(shape: dict, vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        hidden_act="silu",
        **shape,
    )
    return LlamaForCausalLM(config)


def train(
    model, data: torch.Tensor, minutes: float, seq_len: int, batch: int, lr: float, seed: int
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget_s = minutes * 60
    warmup_s = min(60.0, budget_s * 0.05)
    start = time.time()
    step = tokens = 0
    model.train()
    # the budget is wall-clock time, so the bar counts seconds (its ETA is exact)
    progress = Progress("train", total=int(budget_s), unit="s")
    while True:
        elapsed = time.time() - start
        if elapsed >= budget_s:
            break
        # the schedule follows wall-clock time, since the step count is unknown in advance
        frac = elapsed / budget_s
        scale = min(1.0, (elapsed + 1) / warmup_s) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
        )
        for group in opt.param_groups:
            group["lr"] = lr * scale
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # HF shifts labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += batch * seq_len
        progress.set(int(elapsed), step=step, loss=f"{loss.item():.3f}")
        if step % 25 == 0 and not progress.tty:  # on a terminal the progress line says it
            log(
                f"step {step} loss {loss.item():.3f} lr {lr * scale:.2e} "
                f"tokens {tokens / 1e6:.2f}M elapsed {elapsed / 60:.1f} min"
            )
    progress.close()
    return {"steps": step, "tokens_seen": tokens, "minutes": (time.time() - start) / 60}


@torch.inference_mode()
def perplexity(model, data: torch.Tensor, seq_len: int, max_tokens: int) -> tuple[float, int]:
    model.eval()
    total_nll, total = 0.0, 0
    for begin in range(0, min(data.numel(), max_tokens) - seq_len, seq_len):
        x = data[begin : begin + seq_len + 1].long().unsqueeze(0)
        logits = model(input_ids=x[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum")
        total_nll += nll.item()
        total += seq_len
    return math.exp(total_nll / total), total


def save(model, tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(out, safe_serialization=True)
    model.float()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "model_max_length": 2048,
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "added_tokens_decoder": {
                    str(tok.token_to_id(t)): {
                        "content": t,
                        "special": True,
                        "lstrip": False,
                        "rstrip": False,
                        "normalized": False,
                        "single_word": False,
                    }
                    for t in SPECIALS
                },
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "additional_special_tokens": SPECIALS[1:],
            },
            indent=2,
        )
    )
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="models")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--main-minutes", type=float, default=28.0)
    ap.add_argument("--draft-minutes", type=float, default=7.0)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=200_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--only",
        choices=["demo-code", "demo-draft"],
        default=None,
        help="train just one of the two models",
    )
    ap.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="start from the weights already in --out (a second, warm-restarted "
        "cosine run) instead of from scratch; the tokenizer there is reused",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    out = Path(args.out)
    t0 = time.time()
    train_paths, held_paths = corpus_files()
    train_texts, held_texts = read(train_paths), read(held_paths)
    corpus = {
        "train_files": len(train_texts),
        "heldout_files": len(held_texts),
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "heldout_bytes": sum(len(t.encode()) for t in held_texts),
    }
    log(f"corpus {corpus}")
    if args.resume:
        tok = Tokenizer.from_file(str(out / (args.only or "demo-code") / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_texts, args.vocab_size)
    log(f"tokenizer trained ({tok.get_vocab_size()} tokens) in {time.time() - t0:.0f} s")
    train_ids, held_ids = encode_all(tok, train_texts), encode_all(tok, held_texts)
    corpus.update(train_tokens=int(train_ids.numel()), heldout_tokens=int(held_ids.numel()))
    log(
        f"encoded: {train_ids.numel() / 1e6:.1f}M train tokens, {held_ids.numel() / 1e6:.2f}M "
        f"held-out tokens ({time.time() - t0:.0f} s)"
    )
    report_path = out / "demo_eval.json"
    report = json.loads(report_path.read_text()) if args.resume and report_path.is_file() else {}
    report.update(
        {"corpus": corpus, "seed": args.seed, "seq_len": args.seq_len, "batch": args.batch}
    )
    for name, shape, minutes, lr in (
        ("demo-code", MAIN_SHAPE, args.main_minutes, 2e-3),
        ("demo-draft", DRAFT_SHAPE, args.draft_minutes, 3e-3),
    ):
        if args.only and name != args.only:
            continue
        previous = report.get(name, {}) if args.resume else {}
        if args.resume:
            from transformers import LlamaForCausalLM

            model = LlamaForCausalLM.from_pretrained(out / name, dtype=torch.float32)
            lr /= 2  # a warm restart from trained weights
        else:
            model = make_model(shape, tok.get_vocab_size(), args.seed)
        params = sum(p.numel() for p in model.parameters())
        log(f"{name}: {params / 1e6:.2f}M parameters, training {minutes} min")
        stats = train(model, train_ids, minutes, args.seq_len, args.batch, lr, args.seed)
        save(model, tok, out / name)
        from transformers import LlamaForCausalLM

        shipped = LlamaForCausalLM.from_pretrained(out / name, dtype=torch.float32)
        ppl, n = perplexity(shipped, held_ids, args.seq_len, args.eval_tokens)
        log(f"{name}: held-out perplexity {ppl:.2f} over {n} tokens (fp16 weights)")
        if previous:  # add this run's time and tokens to the earlier runs'
            stats = {k: stats[k] + previous.get(k, 0) for k in ("steps", "tokens_seen", "minutes")}
            stats["runs"] = previous.get("runs", 1) + 1
        report[name] = {
            "parameters": params,
            "shape": shape,
            **stats,
            "heldout_perplexity": ppl,
            "heldout_tokens_evaluated": n,
        }
        report_path.write_text(json.dumps(report, indent=2))
    log(f"done in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
