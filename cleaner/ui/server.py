"""Starting `cleaner ui`: where it may listen, the snapshot it serves, uvicorn.

Loopback only by default. Any other address serves the warehouse to whoever reaches the port, so
it needs a token (docs/architecture.md §14); that is checked before anything is read.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from cleaner.errors import CleanerError
from cleaner.warehouse import Warehouse
from cleaner.warehouse.browse import Browser

logger = logging.getLogger(__name__)


class UiError(CleanerError):
    """`cleaner ui` cannot start as asked."""


@dataclass(frozen=True)
class UiConfig:
    warehouse: Path  # the warehouse directory to serve, read-only
    host: str = "127.0.0.1"  # address to listen on; not loopback needs a token
    port: int = 8765  # TCP port
    token: str | None = None  # every request must carry it; required off loopback

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.token is not None and len(self.token) < 8:
            raise ValueError("token must have at least 8 characters")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_host(config: UiConfig) -> None:
    if not is_loopback(config.host) and config.token is None:
        raise UiError(f"--host {config.host} is not a loopback address: anyone who reaches it could read "
                      "the warehouse; give --token T (every request must then carry it) or use 127.0.0.1")


def address(config: UiConfig, port: int) -> str:
    """The URL to open (with the token, which then sets a cookie)."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    query = f"/?token={quote(config.token)}" if config.token else "/"
    return f"http://{host}:{port}{query}"


def listen(config: UiConfig) -> socket.socket:
    """The listening socket (bound here, so a taken port is one clear error, not a server log)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host.strip("[]"), config.port))
    except OSError as error:
        sock.close()
        raise UiError(f"cannot listen on {config.host}:{config.port}: {error.strerror or error}") from error
    return sock


def serve(config: UiConfig, started=None) -> None:
    """Check the host, take the snapshot (a bad warehouse fails here), serve until interrupted;
    `started(url)` is called once the socket listens."""
    check_host(config)
    import uvicorn  # the `ui` extra (start-up time of the other commands)

    from cleaner.ui.app import create_app  # the `ui` extra

    browser = Browser(Warehouse(config.warehouse, read_only=True))
    app = create_app(browser, config.token, loopback=is_loopback(config.host))
    sock = listen(config)
    url = address(config, sock.getsockname()[1])
    logger.info("serving %s read-only at %s", config.warehouse, url)
    if started is not None:
        started(url)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
