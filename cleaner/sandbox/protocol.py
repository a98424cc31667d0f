"""Length-prefixed JSON messages between the pool, its workers and their children.

A message is a 4-byte little-endian payload length, then that many bytes of UTF-8 JSON. The same
framing carries pool <-> worker requests and replies (over the worker's stdin/stdout) and worker ->
child requests (over the child's request pipe).

Design decisions:
- Plain file descriptors and `os.read`/`os.write`, no buffered file objects: the worker forks,
  and a buffer holding half a message must never be duplicated into a child.
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


def send_message(fd: int, message: dict) -> None:
    payload = json.dumps(message).encode("utf-8")
    data = HEADER.pack(len(payload)) + payload
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def receive_message(fd: int) -> dict | None:
    """The next message, or None at end of stream."""
    header = _read_exactly(fd, HEADER.size)
    if header is None:
        return None
    payload = _read_exactly(fd, HEADER.unpack(header)[0])
    return None if payload is None else json.loads(payload)


def _read_exactly_before(fd: int, size: int, deadline: float) -> bytes:
    poller = select.poll()  # not select.select: it refuses a descriptor >= 1024 (module notes)
    poller.register(fd, select.POLLIN)
    buffer = bytearray()
    while len(buffer) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(math.ceil(remaining * 1000)):
            raise PeerLost("worker did not answer in time")
        chunk = os.read(fd, size - len(buffer))
        if not chunk:
            raise PeerLost("worker closed its pipe")
        buffer += chunk
    return bytes(buffer)


def receive_message_before(fd: int, deadline: float) -> dict:
    """Read one message before the `time.monotonic()` deadline, else raise PeerLost."""
    (size,) = HEADER.unpack(_read_exactly_before(fd, HEADER.size, deadline))
    return json.loads(_read_exactly_before(fd, size, deadline))
