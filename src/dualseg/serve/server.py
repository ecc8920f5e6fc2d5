"""Running the app: the port checked before the banner, uvicorn until Ctrl-C, the request
log on stderr (FastAPI-free)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Iterator
from typing import Any

from dualseg.errors import ConfigError


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` once, as uvicorn will, so that a taken port is one line before the
    banner, not a traceback after it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as err:
        raise ConfigError(f"--host {host}: cannot resolve it ({err.strerror or err})") from err
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                why = f"cannot listen on {host}: it is no address of this machine; use 127.0.0.1"
            else:  # in use, or a port below 1024 without administrator rights
                why = (
                    f"cannot listen on {host}:{port} ({err.strerror or err}); stop the program "
                    "using it or choose another --port"
                )
            raise ConfigError(why) from err


def run_server(uvicorn: Any, app: Any, *, host: str, port: int, log_level: str) -> None:
    """Serve until Ctrl-C / SIGTERM; then the requests still waiting for a worker are answered
    503 at once (uvicorn would wait for every open request, the whole queue)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    stop = server.handle_exit

    def handle_exit(sig: int, frame: Any) -> None:
        with contextlib.suppress(RuntimeError):  # no loop running (yet): nothing waits
            asyncio.get_running_loop().call_soon_threadsafe(app.state.workers.close)
        stop(sig, frame)

    server.handle_exit = handle_exit
    server.run()


@contextlib.contextmanager
def request_log_on_stderr() -> Iterator[None]:
    """One line per request (the ``dualseg.serve`` logger) on stderr while serving."""
    logger = logging.getLogger("dualseg.serve")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
