"""The error a model that cannot be served raises at load (torch-free, so the tokenizer and the
GGUF reader can raise it too). The CLI prints its message and exits non-zero."""


class ModelLoadError(ValueError):
    """A model directory or file that cannot be loaded, with a message that says what to fix."""
