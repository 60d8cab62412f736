"""Tiered conversation KV: slot state exported to host memory, disk and Redis, and restored.

`fingerprint` says what a blob depends on, `blob` frames and checks it, `host`/`disk`/
`redis_tier` store it, `manager` decides what to save and restore (torch-free, like core/).
"""
