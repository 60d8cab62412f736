"""The prompt of a chat call: the message type, the template and the tokenize step.

Every chat call (plain, session, Responses, Realtime, Anthropic, Ollama) renders and tokenizes
its messages here, so this sits below the front ends and the call pipeline (server/calls.py).
- chat_tokens.py: `ChatMessage`, `encode_chat` (the template rendered, a stored answer's own
  ids reused) and `answer_token_ids`;
- client_text.py: client text tokenized as plain text, never as control tokens.
"""

from ultrafast.server.prompt.chat_tokens import (
    ChatMessage,
    answer_token_ids,
    encode_chat,
    encode_plain,
)

__all__ = ["ChatMessage", "answer_token_ids", "encode_chat", "encode_plain"]
