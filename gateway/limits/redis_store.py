"""The Redis store: the buckets every gateway shares, in one Redis (``gateway.state``).

An atomic Lua script refills, checks and charges every bucket that applies to an admission, all
or none; the admissions that arrive in the same turn of the event loop go in one call (up to
MAX_BATCH), each still all or none, in order. A bucket is a hash of its tokens and Redis's clock
when they were written (``TIME``, in milliseconds), so gateways whose clocks disagree still agree
on refills; each write expires the key a second after the bucket would be full again, since a
missing bucket reads as full. The allowances come with every call, so a reload's new rpm/tpm
applies at once. Scripts run by EVALSHA; redis-py loads one again when Redis answers NOSCRIPT
(after a restart). Usage corrections are summed per bucket and sent together by
``flush_corrections``, off the response's path."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.config import SharedState
from gateway.limits.buckets import Bucket

# An admission's answer: the refusing bucket's index (-1: all charged), the wait, each one's tokens
Answer = tuple[int, float, list[float]]
Pending = tuple[Sequence[Bucket], int, "asyncio.Future[Answer]"]  # an admission in a batch
MAX_BATCH = 64  # admissions per script call: a call holds Redis for all of them

_BUCKETS = """
local clock = redis.call('TIME')
local now = clock[1] * 1000 + clock[2] / 1000

-- A bucket's tokens now: a missing one is full; a stored one has refilled since it was written,
-- up to its capacity (which a reload may have lowered).
local function refill(key, capacity)
  local state = redis.call('HMGET', key, 'tokens', 'ms')
  local tokens = tonumber(state[1])
  if not tokens then
    return capacity
  end
  local elapsed = now - tonumber(state[2])
  if elapsed > 0 then
    tokens = tokens + elapsed * capacity / 60000
  end
  return math.min(tokens, capacity)
end

local function store(key, capacity, tokens)
  redis.call('HSET', key, 'tokens', tokens, 'ms', now)
  redis.call('PEXPIRE', key, math.ceil((capacity - tokens) * 60000 / capacity) + 1000)
end
"""

# Admissions in turn, each all or none. ARGV: how many; then for each, its number of buckets n,
# their allowances per minute, their charges; KEYS: every admission's buckets, in order. Answers
# one "refused wait_s tokens..." per admission, joined by commas: refused is the 1-based index of
# the bucket with the longest wait, 0 when every one was charged; tokens, each bucket's after the
# charge (or without it). Strings, which redis-py parses faster than arrays.
TAKE = (
    _BUCKETS
    + """
local answers = {}
local k, a = 0, 2  -- KEYS before this admission's; ARGV index of its n
for j = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[a])
  local levels = {}
  local refused, longest = 0, 0
  for i = 1, n do
    local capacity = tonumber(ARGV[a + i])
    local tokens = refill(KEYS[k + i], capacity)
    local need = math.min(tonumber(ARGV[a + n + i]), capacity)
    if tokens < need then
      local wait = (need - tokens) * 60 / capacity
      if wait > longest then
        refused, longest = i, wait
      end
    end
    levels[i] = tokens
  end
  if refused == 0 then
    for i = 1, n do
      levels[i] = levels[i] - tonumber(ARGV[a + n + i])
      store(KEYS[k + i], tonumber(ARGV[a + i]), levels[i])
    end
  end
  answers[j] = refused .. ' ' .. longest .. ' ' .. table.concat(levels, ' ')
  k, a = k + n, a + 2 * n + 1
end
return table.concat(answers, ',')
"""
)

# KEYS: the buckets; ARGV: each one's allowance per minute, then the tokens to charge it more
# (usage minus estimate; a refund when negative, up to a full bucket).
CORRECT = (
    _BUCKETS
    + """
local n = #KEYS
for i = 1, n do
  local capacity = tonumber(ARGV[i])
  store(KEYS[i], capacity, math.min(capacity, refill(KEYS[i], capacity) - tonumber(ARGV[n + i])))
end
return n
"""
)


class RedisStore:
    """Raises redis-py's errors (and OSError) as they come: SharedLimits decides what they mean."""

    def __init__(self, settings: SharedState) -> None:
        self.timeout_s = settings.timeout_ms / 1000
        self.client = Redis.from_url(
            settings.redis_url,
            password=settings.password,
            # Each call is bounded by asyncio.timeout(timeout_s) instead, connecting and the
            # retry included; redis-py would run every send under a socket timeout as a task of
            # its own (asyncio.wait_for).
            socket_timeout=None,
            # One retry at once, on a fresh connection, for a connection error only: a pooled
            # connection that a Redis restart closed fails at its next use. Nothing more: while
            # Redis is down the on_error policy answers, and a background probe finds it back.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            client_name="modelyard-gateway",
        )
        self.prefix = settings.key_prefix
        self._take = self.client.register_script(TAKE)
        self._correct = self.client.register_script(CORRECT)
        self._corrections: dict[str, list[int]] = {}  # key → [per minute, tokens to charge]
        self._batch: list[Pending] | None = None
        self._sending: set[asyncio.Future[None]] = set()

    def take(self, buckets: Sequence[Bucket], estimate: int) -> asyncio.Future[Answer]:
        """Joins the batch that goes to Redis at the event loop's next turn: the admissions that
        come meanwhile share one script call, so a loaded gateway makes far fewer calls than it
        serves requests."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        if self._batch is None or len(self._batch) == MAX_BATCH:
            self._batch = []
            sending = asyncio.ensure_future(self._send(self._batch))
            self._sending.add(sending)
            sending.add_done_callback(self._sending.discard)
        self._batch.append((buckets, estimate, future))
        return future

    async def _send(self, batch: list[Pending]) -> None:
        if self._batch is batch:
            self._batch = None  # later admissions start the next batch
        keys: list[str] = []
        args: list[int] = [len(batch)]
        for buckets, estimate, _ in batch:
            keys += [self.prefix + b.id for b in buckets]
            args.append(len(buckets))
            args += [b.per_minute for b in buckets]
            args += [estimate if b.counts_tokens else 1 for b in buckets]
        try:
            async with asyncio.timeout(self.timeout_s):
                reply = await self._take(keys=keys, args=args)
        except Exception as exc:  # every admission of the batch fails with it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except asyncio.CancelledError:
            for *_, future in batch:
                future.cancel()
            raise
        for (*_, future), answer in zip(batch, reply.split(b","), strict=True):
            if not future.done():  # else its request is gone
                fields = answer.split()
                refused, wait_s = int(fields[0]) - 1, float(fields[1])
                future.set_result((refused, wait_s, [float(f) for f in fields[2:]]))

    def add_correction(self, buckets: Sequence[Bucket], delta: int) -> None:
        for bucket in buckets:
            key = self.prefix + bucket.id
            pending = self._corrections.get(key)
            if pending is None:
                self._corrections[key] = [bucket.per_minute, delta]
            else:
                pending[0] = bucket.per_minute
                pending[1] += delta

    def drop_corrections(self) -> None:
        self._corrections.clear()

    async def flush_corrections(self) -> None:
        """Sends the corrections added so far, one script call for all (lost if it fails)."""
        pending, self._corrections = self._corrections, {}
        if pending:
            values = pending.values()
            args = [v[0] for v in values] + [v[1] for v in values]
            async with asyncio.timeout(self.timeout_s):
                await self._correct(keys=list(pending), args=args)

    async def probe(self) -> None:
        """The admission script with no bucket: answers once Redis runs scripts again (and
        loads it there, when Redis lost it)."""
        async with asyncio.timeout(self.timeout_s):
            await self._take(keys=[], args=[0])

    async def close(self) -> None:
        for sending in list(self._sending):
            sending.cancel()
        await self.client.aclose()
