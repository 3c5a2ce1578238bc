"""The wire between the gateway and an engine template (``python -m engine.template``): the
template's command line, and the messages both send over one ``SOCK_SEQPACKET`` Unix socket
pair (one JSON object per packet, so no framing; a fork request carries the engine's output pipe
as a file descriptor, SCM_RIGHTS).

template → gateway: ``ready`` (imports done, it takes forks), ``forked`` (a fork request's
answer: the engine's pid, or an error), ``exited`` (an engine ended: its raw wait status, which
only the template, its parent, can read). gateway → template: ``fork``, and ``prepare`` (an
engine it may be asked to fork later: what that engine will need, built while the template is
idle; no answer). The gateway closing its end asks the template to exit."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from typing import Any

from common.engine_args import SPIN_WAIT_FLAG

TEMPLATE_MODULE = "engine.template"
SOCKET_FD_FLAG = "--socket-fd"  # the template's end of the socket pair, inherited
# Room in the template's own command line for each engine's: a forked engine writes its
# `python -m engine ...` there, so that ps and /proc/PID/cmdline show which engine it is.
CMDLINE_ROOM_FLAG = "--cmdline-room"
CMDLINE_ROOM = 4096
MAX_MESSAGE_BYTES = 1 << 16

READY = "ready"  # {"pid", "imports_s"}
FORK = "fork"  # {"id", "argv": the `python -m engine` flags, "cwd"} + the output fd
FORKED = "forked"  # {"id", "pid"} or {"id", "error"}
EXITED = "exited"  # {"pid", "status"}: os.waitpid's status
PREPARE = "prepare"  # {"argv": an engine's `python -m engine` flags, "cwd"}


class WireError(RuntimeError):
    """A message that is not one: the peer is not speaking this protocol."""


def encode(kind: str, **fields: Any) -> bytes:
    data = json.dumps({"kind": kind, **fields}).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"{kind} message of {len(data)} bytes (at most {MAX_MESSAGE_BYTES})")
    return data


def decode(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except ValueError as error:
        raise WireError(f"not JSON: {error}") from None
    if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
        raise WireError(f"not a message: {data[:200]!r}")
    return message


def send(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """One packet (raises BlockingIOError on a full non-blocking socket: nothing was sent)."""
    socket.send_fds(sock, [data], list(fds))


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[bytes, list[int]]:
    """One packet and the descriptors it carried (b"" once the peer has closed its end)."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, max_fds)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            socket.close(fd)
        raise WireError("a message or its descriptors were cut short")
    return data, fds


def template_argv(socket_fd: int, spin_wait: bool) -> list[str]:
    """The arguments of ``python -m engine.template`` (after the module name)."""
    argv = [SOCKET_FD_FLAG, str(socket_fd)]
    if spin_wait:
        argv.append(SPIN_WAIT_FLAG)
    return [*argv, CMDLINE_ROOM_FLAG, " " * CMDLINE_ROOM]
