"""Forwarding requests to backends: timeouts, retries on another replica, SSE pass-through.

Retries happen only while nothing has been sent to the client: a unary answer is read in full
before it is sent (``unary.py``), and a stream's response headers go out only once its first
upstream chunk has arrived (``stream.py``); ``retries.py`` picks the replicas, ``budget.py``
bounds how many retries the fleet gets, ``failures.py`` says what each failure looks like to the
client, ``upstream.py`` sends an attempt and tells passive health what came of it, ``sse.py``
relays the events, ``quarantine.py`` keeps a request that crashed its engine from crashing it again.

Timeouts: ``connect_s`` (TCP connect), ``first_byte_s`` (to the response headers; for streams to the
first chunk), ``idle_s`` (between chunks while reading), ``total_s`` (whole request). Each answers
504 before a stream started, or ends a started stream with an SSE error event.
"""

from gateway.proxy.exchange import Exchange
from gateway.proxy.forward import Proxy

__all__ = ["Exchange", "Proxy"]
