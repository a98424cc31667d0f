"""Length-prefixed JSON messages between the pool, its workers and their children.

A message is a 4-byte little-endian payload length, then that many bytes of UTF-8 JSON. The same
framing carries pool <-> worker requests and replies (over the worker's stdin/stdout) and worker ->
child requests (over the child's request pipe).

Design decisions:
- Plain file descriptors and `os.read`/`os.write`, no buffered file objects: the worker forks,
  and a buffer holding half a message must never be duplicated into a child.
- Frames are bytes (`send_frame`, `receive_frame`); messages are JSON in them. The reward workers
  (engine/grading/workers.py) send pickles in the same frames.
- Two readers. `receive_message` blocks and returns None at end of stream: a worker or a child has
  nothing else to do until its peer speaks or goes away. `receive_message_before` is the pool's: it
  gives up at a deadline and raises `PeerLost`, so a hung or dead worker never hangs the caller.
  It waits with `poll`, not `select`, which refuses a descriptor >= 1024 (FD_SETSIZE): the pool
  lives in the collection's process, whose sockets (a thousand rollouts' requests) and files push
  its pipes' descriptors past that.
"""

from __future__ import annotations

import json
import math
import os
import select
import struct
import time

HEADER = struct.Struct("<I")  # payload length


class PeerLost(Exception):
    """The other end died, closed its pipe or did not answer in time."""


def send_frame(fd: int, payload: bytes) -> None:
    """Write one frame: the payload's length, then the payload."""
    data = HEADER.pack(len(payload)) + payload
    while data:
        data = data[os.write(fd, data):]


def receive_frame(fd: int, deadline: float | None = None) -> bytes:
    """The next frame's payload: EOFError at end of stream, TimeoutError once the `time.monotonic()`
    deadline passes (None: wait as long as it takes). The reward workers frame their pickles so too."""
    poller = None
    if deadline is not None:
        poller = select.poll()  # not select.select: it refuses a descriptor >= 1024 (module notes)
        poller.register(fd, select.POLLIN)

    def read(size: int) -> bytes:
        buffer = bytearray()
        while len(buffer) < size:
            if poller is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not poller.poll(math.ceil(remaining * 1000)):
                    raise TimeoutError
            chunk = os.read(fd, size - len(buffer))
            if not chunk:
                raise EOFError
            buffer += chunk
        return bytes(buffer)

    return read(HEADER.unpack(read(HEADER.size))[0])


def send_message(fd: int, message: dict) -> None:
    send_frame(fd, json.dumps(message).encode("utf-8"))


def receive_message(fd: int) -> dict | None:
    """The next message, or None at end of stream."""
    try:
        return json.loads(receive_frame(fd))
    except EOFError:
        return None


def receive_message_before(fd: int, deadline: float) -> dict:
    """Read one message before the `time.monotonic()` deadline, else raise PeerLost."""
    try:
        return json.loads(receive_frame(fd, deadline))
    except TimeoutError:
        raise PeerLost("worker did not answer in time") from None
    except EOFError:
        raise PeerLost("worker closed its pipe") from None
