"""Running the server: uvicorn serves the FastAPI application (`app`) on a thread, while the main
thread runs the engine (`GenerationEngine.run`: on the reference device its compiled CPU kernels run
fastest there).

On SIGTERM or Ctrl-C uvicorn stops taking connections and lets the requests running finish
(`drain_seconds` at most); then the application's shutdown stops the engine, and the process
exits 0.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import uvicorn

from ..generation.engine import GenerationEngine
from .app import build_app

DEFAULT_HOST = "127.0.0.1"  # this machine only, unless asked otherwise
DEFAULT_PORT = 8000


def run_server(engine: GenerationEngine, model_name: str, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
               api_key: str | None = None, drain_seconds: int = 120, show_progress: bool = True,
               tool_parser: str | None = None, processor: Any = None) -> None:
    """Serves `engine` over HTTP until SIGTERM or Ctrl-C; call it from the main thread. The engine
    compiles its graphs while the HTTP side already answers (`/health`: 503 until they are ready).

    Args:
        engine (`GenerationEngine`): the engine, not started.
        model_name (`str`): the name clients give as `model`.
        host (`str`): the address to bind; the default takes connections from this machine only.
        port (`int`): the TCP port.
        api_key (`str`, *optional*): the key every route but `/health` wants.
        drain_seconds (`int`): after SIGTERM, how long the requests running may take to finish.
        show_progress (`bool`): a progress bar while the graphs compile.
        tool_parser (`str`, *optional*): how answers write tool calls (see `build_app`).
        processor (`ProcessorMixin`, *optional*): a vision-language model's (see `build_app`).
    """
    app = build_app(engine, model_name, api_key=api_key, tool_parser=tool_parser, processor=processor)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=drain_seconds, log_level="info")
    server = uvicorn.Server(config)  # (on a thread other than the main one, uvicorn leaves signals alone)
    http = threading.Thread(target=server.run, name="neuron-serving-http")
    handlers = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        engine.run(show_progress)  # until the application's shutdown stops it
        if not server.should_exit:  # (the engine failed: stop serving)
            server.should_exit = True
        http.join()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if engine.failure is not None:
        raise RuntimeError("the serving engine failed") from engine.failure
