"""Server-side conversations: the session store and every API that reads or writes it.

- store.py: the store interface, `Turn`, `StoredObject`; sqlite.py and redis.py, its backends,
  chosen by URL in backends.py (`open_store`).
- flow.py: `SessionFlow` (typed store calls with their errors in the OpenAI envelope, the
  assistant commit with retries) and `ChatSession` (chat completions with `session_id`).
- chat_tokens.py: `ChatMessage`, and the prompt ids that reuse a stored answer's own ids;
  client_text.py: client text tokenized as plain text, never as control tokens.
- responses.py, conversations.py, realtime.py: the Responses, Conversations and Realtime APIs.
- stored_chat.py: chat completions stored with `store: true` (GET, list, delete, messages).
- replay.py: the stored answer to a chat call retried with its Idempotency-Key.
Every generation goes through server/calls.py, like a plain chat completion.
"""
