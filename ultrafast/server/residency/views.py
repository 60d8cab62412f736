"""A resident model's view of the server state, completed on the event loop."""

from __future__ import annotations

import asyncio

from ultrafast.server.bridge import EngineBridge
from ultrafast.server.state import ServerState


def view_with_bridge(view: ServerState) -> ServerState:
    """The view, with its bridge to its own engine made on the running loop the first time."""
    if view.bridge is None:
        view.bridge = EngineBridge(
            view.engine, asyncio.get_running_loop(), view.config.max_stream_buffer_events
        )
    return view
