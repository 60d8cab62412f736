"""Ollama's model routes: `/api/tags`, `/api/show`, `/api/ps`, `/api/version`, and `GET` /
`HEAD /` ("Ollama is running"), plus the name resolution every Ollama route uses.

Names: Ollama clients send `name:tag`; `name` and `name:latest` resolve to the served model
`name` (case-insensitive), the exact served name always does. Listings show `name:latest`.
`digest` is an identity digest (sha256 of the file's path, size and mtime), not the file's
hash, which would mean reading gigabytes per listing. `/api/show`'s `model_info` is the GGUF's
metadata (the tokenizer's arrays only with `verbose`), `template` the chat template,
`parameters` the model's own sampling defaults. `/api/ps` lists the loaded models with the
bytes they hold (weights + KV pool with `--models`, the weights alone otherwise).

Embedding models (`--models chat=a.gguf,emb=minilm.gguf`, or one served alone) are listed
too, as Ollama lists them: in `/api/tags`, in `/api/ps` (always loaded: they are kept), and
`/api/show` gives `capabilities: ["embedding"]` (Ollama's answer for a model whose GGUF
declares a pooling type), the GGUF's family (`bert`) and no template or parameters.

`GET /` is content-negotiated: a client that accepts `text/html` (a browser) gets the
playground, any other (curl, Ollama clients' probes) the plain "Ollama is running".
"""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ultrafast.model.gguf_meta import read_gguf_metadata
from ultrafast.model_files import ModelFiles, resolve_model
from ultrafast.server.errors import APIError, invalid_value, quote
from ultrafast.server.playground import playground
from ultrafast.server.residency.budget import weight_bytes
from ultrafast.server.state import ServerState, read_json

OLLAMA_API_VERSION = "0.12.0"  # the Ollama API version these routes follow
ZERO_TIME = "0001-01-01T00:00:00Z"  # Ollama's "never" for expires_at
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1"}
FILE_TYPES |= {10: "Q2_K", 11: "Q3_K_S", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S"}
FILE_TYPES |= {17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def served_names(state: ServerState) -> list[str]:
    """The chat models, then the embedding models (each name once)."""
    chat = list(state.models.runtimes)
    return chat + [name for name in state.embedders if name not in chat]


def resolve_name(state: ServerState, name: Any, param: str = "model") -> str:
    """The served name an Ollama client's `name[:tag]` means; 404 in Ollama's words."""
    if not isinstance(name, str) or not name:
        raise invalid_value(param, f"{param} is required")
    names = served_names(state)
    if name in names:
        return name
    base = name.removesuffix(":latest").lower()
    for served in names:
        if served.lower() == base:
            return served
    raise APIError(
        404, f"model {quote(name, 256)} not found", "not_found_error", "model_not_found", param
    )


def files_of(state: ServerState, name: str) -> ModelFiles | None:
    if name in state.embedders:
        return resolve_model(state.embedders[name].gguf_path)
    if state.residency is not None:
        paths = dict(state.config.models)
        return resolve_model(paths[name]) if name in paths else None
    return state.models.default.files


def _gguf_meta(files: ModelFiles | None):
    if files is None or files.gguf_path is None:
        return None
    return read_gguf_metadata(files.gguf_path)


def details(files: ModelFiles | None) -> dict:
    meta = _gguf_meta(files)
    arch = meta.architecture if meta is not None else ""
    params = sum(_numel(t.shape) for t in meta.tensors) if meta is not None else 0
    file_type = meta.get("general.file_type") if meta is not None else None
    return {
        "parent_model": "",
        "format": "gguf" if meta is not None else "safetensors",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": _size_label(params) if params else "",
        "quantization_level": FILE_TYPES.get(file_type, "") if isinstance(file_type, int) else "",
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _size_label(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _main_file(files: ModelFiles | None) -> Path | None:
    if files is None:
        return None
    if files.gguf_path is not None:
        return Path(files.gguf_path)
    return Path(files.hf_dir) if files.hf_dir is not None else None


def digest(files: ModelFiles | None) -> str:
    path = _main_file(files)
    if path is None or not path.exists():
        return ""
    stat = path.stat()
    return hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()


def modified_at(files: ModelFiles | None) -> str:
    path = _main_file(files)
    if path is None or not path.exists():
        return ZERO_TIME
    stamp = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc)
    return stamp.isoformat().replace("+00:00", "Z")


def _listing(state: ServerState, name: str) -> dict:
    files = files_of(state, name)
    return {
        "name": f"{name}:latest",
        "model": f"{name}:latest",
        "modified_at": modified_at(files),
        "size": weight_bytes(files) if files is not None else 0,
        "digest": digest(files),
        "details": details(files),
    }


def model_info(files: ModelFiles | None, verbose: bool) -> dict:
    meta = _gguf_meta(files)
    if meta is None:
        return {}
    out: dict[str, Any] = {}
    for key, value in meta.fields.items():
        if isinstance(value, list) and not verbose and len(value) > 64:
            out[key] = None  # as Ollama: the tokenizer's arrays only when verbose
        else:
            out[key] = value
    return out


def _parameters(state: ServerState, name: str) -> str:
    limits = state.limits_for(name)
    names = {"repetition_penalty": "repeat_penalty"}
    return "\n".join(f"{names.get(k, k)} {v:g}" for k, v in limits.sampling_defaults)


def _tokenizer_of(state: ServerState, name: str):
    """The model's tokenizer when it is in memory (one model, or a loaded one of several)."""
    if name in state.embedders:
        return None  # no chat template to show
    if state.residency is None:
        return state.models.default.tokenizer
    resident = state.residency.entries[name].resident
    return None if resident is None else resident.runtime.tokenizer


def _ps_entry(state: ServerState, name: str) -> dict:
    files = files_of(state, name)
    gpu = state.models.snapshot().device_kind == "gpu"
    registry = state.residency
    entry = None
    if registry is not None and name not in state.embedders:
        entry = registry.entries[name]
    size = entry.num_bytes if entry is not None else weight_bytes(files) if files else 0
    expires = ZERO_TIME
    if registry is not None and entry is not None and entry.expires_s is not None:
        wall = time.time() + (entry.expires_s - registry.clock())
        expires = (
            dt.datetime.fromtimestamp(wall, dt.timezone.utc).isoformat().replace("+00:00", "Z")
        )
    return {
        **_listing(state, name),
        "expires_at": expires,
        "size_vram": size if gpu else 0,
        "context_length": _context_length(state, name, entry),
    }


def _context_length(state: ServerState, name: str, entry: Any) -> int:
    if name in state.embedders:
        return state.embedders[name].max_input_tokens
    return entry.extra.get("max_model_len", 0) if entry else state.models.default.max_model_len


def _capabilities(state: ServerState, name: str) -> list[str]:
    """Ollama's: an embedding model embeds and nothing else; a chat model completes, and
    calls tools where its template renders them."""
    if name in state.embedders:
        return ["embedding"]
    if "tools" in state.limits_for(name).features:
        return ["completion", "tools"]
    return ["completion"]


def model_routes(state: ServerState) -> list[Route]:
    async def tags(http: HTTPRequest) -> Response:
        return JSONResponse({"models": [_listing(state, n) for n in served_names(state)]})

    async def show(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        name = resolve_name(state, body.get("model", body.get("name")))
        files = files_of(state, name)
        tokenizer = _tokenizer_of(state, name)
        embedder = name in state.embedders
        return JSONResponse(
            {
                "modelfile": f"FROM {_main_file(files) or name}\n",
                "parameters": "" if embedder else _parameters(state, name),
                "template": (tokenizer.chat_template or "") if tokenizer is not None else "",
                "details": details(files),
                "model_info": model_info(files, body.get("verbose") is True),
                "capabilities": _capabilities(state, name),
                "modified_at": modified_at(files),
            }
        )

    async def ps(http: HTTPRequest) -> Response:
        if state.residency is not None:
            loaded = [e.name for e in state.residency.loaded()]
        else:
            loaded = [state.model_name]
        loaded += [name for name in state.embedders if name not in loaded]
        return JSONResponse({"models": [_ps_entry(state, n) for n in loaded]})

    async def version(http: HTTPRequest) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    return [
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/version", version, methods=["GET"]),
        Route("/", root, methods=["GET", "HEAD"]),
    ]


async def root(http: HTTPRequest) -> Response:
    if http.method == "GET" and "text/html" in http.headers.get("accept", ""):
        return await playground(http)
    return PlainTextResponse("Ollama is running")
