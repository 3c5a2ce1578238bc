"""The Redis store: the buckets every gateway shares, in one Redis (``gateway.state``).

One atomic Lua script per admission refills, checks and charges every bucket that applies (all or
none). A bucket is a hash of its tokens and Redis's clock when they were written (``TIME``, in
milliseconds), so gateways whose clocks disagree still agree on refills; each write expires the
key a second after the bucket would be full again, since a missing bucket reads as full. The
allowances come with every call, so a reload's new rpm/tpm applies at once. Scripts run by
EVALSHA; redis-py loads one again when Redis answers NOSCRIPT (after a restart). Usage corrections
are summed per bucket and sent together by ``flush_corrections``, off the response's path."""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.config import SharedState
from gateway.limits.buckets import Bucket

_BUCKETS = """
local clock = redis.call('TIME')
local now = clock[1] * 1000 + clock[2] / 1000
local n = #KEYS

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

# KEYS: the buckets; ARGV: each one's allowance per minute, then each one's charge. Answers
# "refused wait_s tokens...": refused is the 1-based index of the bucket with the longest wait, 0
# when every one was charged; tokens, each bucket's after the charge (or without it). One string,
# which redis-py parses faster than an array.
TAKE = (
    _BUCKETS
    + """
local levels = {}
local refused, longest = 0, 0
for i = 1, n do
  local capacity = tonumber(ARGV[i])
  local tokens = refill(KEYS[i], capacity)
  local need = math.min(tonumber(ARGV[n + i]), capacity)
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
    levels[i] = levels[i] - tonumber(ARGV[n + i])
    store(KEYS[i], tonumber(ARGV[i]), levels[i])
  end
end
return refused .. ' ' .. longest .. ' ' .. table.concat(levels, ' ')
"""
)

# KEYS: the buckets; ARGV: each one's allowance per minute, then the tokens to charge it more
# (usage minus estimate; a refund when negative, up to a full bucket).
CORRECT = (
    _BUCKETS
    + """
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
        timeout_s = settings.timeout_ms / 1000
        self.client = Redis.from_url(
            settings.redis_url,
            password=settings.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
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

    async def take(
        self, buckets: Sequence[Bucket], estimate: int
    ) -> tuple[int, float, list[float]]:
        """(refused: the refusing bucket's index or -1, wait_s, each bucket's tokens)."""
        args = [b.per_minute for b in buckets]
        args += [estimate if b.counts_tokens else 1 for b in buckets]
        reply = await self._take(keys=[self.prefix + b.id for b in buckets], args=args)
        fields = reply.split()
        return int(fields[0]) - 1, float(fields[1]), [float(f) for f in fields[2:]]

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
            await self._correct(keys=list(pending), args=args)

    async def probe(self) -> None:
        """The admission script with no bucket: answers once Redis runs scripts again (and
        loads it there, when Redis lost it)."""
        await self._take(keys=[], args=[])

    async def close(self) -> None:
        await self.client.aclose()
