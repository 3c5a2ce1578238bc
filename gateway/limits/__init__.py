"""Rate limits: requests/min and tokens/min per API key and per model, as token buckets.

``limiter.py`` the limiter and its grants, ``buckets.py`` what every store shares (the bucket,
the headers), ``local.py`` the in-process store. Import from here.
"""

from gateway.limits.buckets import Bucket, TokenBucket
from gateway.limits.limiter import NO_LIMITS, LimitGrant, RateLimited, RateLimiter

__all__ = [
    "NO_LIMITS",
    "Bucket",
    "LimitGrant",
    "RateLimited",
    "RateLimiter",
    "TokenBucket",
]
