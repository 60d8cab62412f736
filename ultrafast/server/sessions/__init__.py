"""Server-side conversations: the session store and the flow every stateful API goes through.

- store.py: the store interface, `Turn`, `StoredObject`; sqlite.py and redis.py, its backends,
  chosen by URL in backends.py (`open_store`).
- flow.py: `SessionFlow` (typed store calls with their errors in the OpenAI envelope, the
  assistant commit with retries) and `ChatSession` (chat completions with `session_id`).
The APIs that read and write it (Responses, Conversations, Realtime, stored chat completions,
the Idempotency-Key replay) are front ends in server/frontends/; the prompt step that reuses a
stored answer's own ids is server/prompt/. Nothing here imports a front end.
"""
