"""A copy of the demo model whose vocabulary has Mistral's `[TOOL_CALLS]` as one special token,
with a Mistral-style chat template, for the tests of special-token tool-call triggers.

The token takes the id of the vocabulary's last BPE merge result (that merge is dropped), so
the demo weights' logits already cover it and the vocabulary keeps its size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ultrafast.config import DEMO_MODEL_DIR

TRIGGER = "[TOOL_CALLS]"

# Mistral's syntax, kept small: tools in [AVAILABLE_TOOLS], calls as [TOOL_CALLS][...], results
# in [TOOL_RESULTS] (these last are plain text here; only the trigger is a special token)
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or m.role == 'system' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    '{"name":{{ c.function.name|tojson }},"arguments":{{ c.function.arguments|tojson }}}'
    "{% if not loop.last %},{% endif %}{% endfor %}]{{ eos_token }}"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def write_tokenizer_json(dst: Path, special: bool = True) -> int:
    """The demo tokenizer.json with TRIGGER as an added token (`special`: marked special, as
    Mistral's control tokens are); returns its id."""
    data = json.loads((DEMO_MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    model = data["model"]
    last = "".join(model["merges"][-1])
    token_id = model["vocab"].pop(last)
    model["vocab"][TRIGGER] = token_id
    model["merges"] = [m for m in model["merges"] if "".join(m) != last and last not in m]
    data["added_tokens"].append(
        {
            "id": token_id,
            "content": TRIGGER,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
    )
    dst.write_text(json.dumps(data), encoding="utf-8")
    return token_id


def make_model_dir(dst: Path) -> int:
    """The demo model (weights linked, not copied) with the trigger token and the Mistral
    template, in `dst`; returns the trigger's id."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_MODEL_DIR / name, dst / name)
    (dst / "model.safetensors").symlink_to(DEMO_MODEL_DIR / "model.safetensors")
    token_id = write_tokenizer_json(dst / "tokenizer.json")
    config = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = MISTRAL_TEMPLATE
    config["added_tokens_decoder"][str(token_id)] = {
        "content": TRIGGER,
        "special": True,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return token_id
