"""`ultrafast generate` and `ultrafast serve`: the commands that run the engine.

Their flags are generated from the config dataclasses' fields (config_flags.py: each field
declares its flag, help, group and default once, in config.py and server_config.py), and the
configs are read back from the parsed flags the same way.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any

from ultrafast.cli_help import SERVE_GROUPS, HelpFormatter, group
from ultrafast.config import EngineConfig, ServerConfig
from ultrafast.config_flags import add_flags, read_config


def add_engine_args(p: argparse.ArgumentParser, chat_template: bool = False) -> None:
    """The engine's flags (generate, chat, serve, cluster): EngineConfig's "main" part, and its
    --chat-template when `chat_template`."""
    add_flags(p, EngineConfig, ("main", "chat_template") if chat_template else ("main",), group)


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig, ("chat_template",), group)


def add_compile_arg(p: argparse.ArgumentParser, help_text: str | None = None) -> None:
    """EngineConfig's `--compile`, with another help text (bench suites that build an engine)."""
    add_flags(p, EngineConfig, names=("compile",), help=help_text)


def chosen_model(explicit: str | None) -> tuple[str, str | None]:
    """(model path, served name or None) for a command given `explicit` or no model. Without
    one, SmolLM2 serves as `smollm2-135m-instruct`; when it was never fetched, one line on
    stderr says so and the demo model serves instead."""
    from pathlib import Path

    from ultrafast.config import SMOLLM2_SERVED_NAME, default_model_choice, smollm2_gguf

    if explicit:
        smollm2 = smollm2_gguf()
        same = smollm2.is_file() and Path(explicit).expanduser().resolve() == smollm2.resolve()
        return explicit, SMOLLM2_SERVED_NAME if same else None
    choice = default_model_choice()
    if choice.fallback_notice:
        print(f"ultrafast: {choice.fallback_notice}", file=sys.stderr)
    return choice.path, choice.served_name


def check_max_model_len(model: str, max_model_len: int | None) -> None:
    """An explicit --max-model-len the model cannot hold is an error that says what fits (the
    default is capped at the model's context instead). Reads only the model's metadata."""
    if max_model_len is None:
        return
    if max_model_len < 1:
        raise ValueError(f"--max-model-len {max_model_len}: give a number of positions >= 1")
    from ultrafast.model_files import resolve_model

    files = resolve_model(model)
    declared = files.max_position_embeddings
    if declared and max_model_len > declared:
        raise ValueError(
            f"--max-model-len {max_model_len:,} does not fit {files.name}: its context is "
            f"{declared:,} positions; give --max-model-len {declared} or less (without the "
            f"flag: {min(declared, EngineConfig.max_model_len)})"
        )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's keyword arguments (all but the model) from the engine flags the command
    has (`--max-model-len` left out: the default, capped at the model's context)."""
    options = read_config(EngineConfig, args)
    options.pop("model", None)
    return options


def kv_cache_options(args: argparse.Namespace) -> dict[str, Any]:
    """The KV tiers' part of engine_options (serve and cluster)."""
    return read_config(EngineConfig, args, ("kv",))


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the serve (or cluster) flags describe; ValueError on a bad value."""
    config = ServerConfig(**read_config(ServerConfig, args))
    unknown = [name for name in config.pinned_models if name not in dict(config.models)]
    if unknown:
        raise ValueError(f"--pin {unknown[0]!r}: not one of the --models names")
    return config


def add_generate_parser(sub: Any) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt, streamed to stdout",
        formatter_class=HelpFormatter,
    )
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    gen.add_argument("--stats", action="store_true", help="print TTFT and speed to stderr")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from ultrafast.llm import LLM
    from ultrafast.request import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    model, _ = chosen_model(args.model)
    check_max_model_len(model, args.max_model_len)
    print(
        "ultrafast: generate continues the prompt as raw text (no chat template); "
        "`ultrafast chat` chats with the model",
        file=sys.stderr,
    )
    llm = LLM(model, **engine_options(args))
    started = time.perf_counter()
    first_s = None
    pieces = []
    sys.stdout.write(args.prompt)
    for delta in llm.stream(args.prompt, params):
        if first_s is None:
            first_s = time.perf_counter() - started
        pieces.append(delta)
        sys.stdout.write(delta)
        sys.stdout.flush()
    total_s = time.perf_counter() - started
    sys.stdout.write("\n")
    num_tokens = len(llm.tokenizer.encode("".join(pieces), add_special_tokens=False))
    if args.stats:
        stats = llm.engine.speculation_stats
        drafted = sum(stats.num_draft_tokens.values()) if stats else 0
        accepted = sum(stats.num_accepted_tokens.values()) if stats else 0
        print(
            f"[{llm.files.name} on {type(llm.engine.executor).__name__}: "
            f"ttft {1000 * (first_s or total_s):.1f} ms, ~{num_tokens} tokens in "
            f"{total_s:.2f} s; speculation {args.speculation}: "
            f"{accepted}/{drafted} drafts accepted]",
            file=sys.stderr,
        )
    llm.close()
    return 0


def add_serve_parser(sub: Any) -> None:
    srv = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        description="Serve a model over the OpenAI API (chat completions, completions, "
        "Responses, Conversations, Realtime), with a browser playground at /.",
        formatter_class=HelpFormatter,
    )
    srv.add_argument(
        "model_path",
        nargs="?",
        default=None,
        help="HF model directory or .gguf (default: SmolLM2-135M-Instruct, served as "
        "smollm2-135m-instruct, when `make setup` fetched it; else the bundled demo model)",
    )
    for title in SERVE_GROUPS:  # the order --help shows them in
        group(srv, title)
    add_flags(srv, ServerConfig, None, group)
    add_flags(srv, EngineConfig, None, group)
    srv.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from ultrafast.server.serve import serve

    # without --threads/--batch-threads the engine times passes of several widths at start
    # and picks each width's thread count (executors/ggml_threads.py)
    config = server_config(args)
    if config.models:  # several models: the first is the default, loaded at start
        if args.model_path or args.model:
            raise ValueError("give the models with --models, or one model, not both")
        args.served_model_name, model = config.models[0]
        config = replace(config, served_model_name=args.served_model_name)
    else:
        model, served_name = chosen_model(args.model_path or args.model)
        if args.served_model_name is None:
            config = replace(config, served_model_name=served_name)
    check_max_model_len(model, args.max_model_len)
    if args.chat_template:  # a bad name or file fails here, before the model loads
        from ultrafast.chat_templates import resolve_chat_template

        resolve_chat_template(args.chat_template)
    engine = EngineConfig(model=model, **engine_options(args))
    return serve(engine, config)
