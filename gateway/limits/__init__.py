"""Rate limits: requests/min and tokens/min per API key and per model, as token buckets kept in
this process or, with ``gateway.state``, in a Redis that several gateways share.

``limiter.py`` the limiter and its grants, ``buckets.py`` what every store shares (the bucket,
the headers), ``local.py`` the in-process store, ``redis_store.py`` the Redis store and its
scripts, ``shared.py`` the Redis store behind its on_error policy. Import from here.
"""

from gateway.limits.buckets import Bucket, TokenBucket
from gateway.limits.limiter import NO_LIMITS, LimitGrant, RateLimited, RateLimiter
from gateway.limits.shared import SharedLimits

__all__ = [
    "NO_LIMITS",
    "Bucket",
    "LimitGrant",
    "RateLimited",
    "RateLimiter",
    "SharedLimits",
    "TokenBucket",
]
