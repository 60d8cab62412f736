"""Tool calling: how tools reach the prompt, which calls the grammar allows, and how the
generated text splits into content and `tool_calls` (formats.py, render.py, grammar.py,
parse.py; plan.py ties them to one request)."""
