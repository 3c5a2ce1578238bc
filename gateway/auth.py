"""API keys: ``Authorization: Bearer <key>`` → the configured key (its name, models and limits).

Keys are looked up by their SHA-256 digest, so lookups take the same time whatever the key's
content, and secrets never appear in logs, metrics or error messages (only key *names* do).
With no keys configured the gateway runs in open mode (loopback only, enforced by the config).
"""

from __future__ import annotations

import hashlib
import hmac

from common.errors import RequestRefused
from gateway.config import ApiKey, AuthSettings

_BEARER = "bearer "


def _digest(secret: str) -> bytes:
    # aiohttp decodes header bytes that are not UTF-8 as surrogate escapes: hash them as sent.
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


class Authenticator:
    def __init__(self, settings: AuthSettings) -> None:
        self.settings = settings
        self._keys = {_digest(k.secret): k for k in settings.keys}
        self._admin = _digest(settings.admin_key) if settings.admin_key else None

    @property
    def open_mode(self) -> bool:
        return self.settings.open_mode

    def client(self, authorization: str | None) -> ApiKey | None:
        """The caller's key; None in open mode. Raises 401 for a missing or unknown key."""
        if not self._keys:
            return None
        token = _bearer(authorization)
        key = self._keys.get(_digest(token))
        if key is None:
            raise RequestRefused(401, "Incorrect API key provided.", code="invalid_api_key")
        return key

    def admin(self, authorization: str | None) -> None:
        """Admin endpoints need the admin key; in open mode without one they are loopback-open."""
        if self._admin is None:
            if self.open_mode:
                return
            raise RequestRefused(
                403,
                "Admin endpoints are disabled: set gateway.auth.admin_key_env to enable them.",
                code="admin_disabled",
            )
        if not hmac.compare_digest(_digest(_bearer(authorization)), self._admin):
            raise RequestRefused(401, "Incorrect admin key provided.", code="invalid_api_key")


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise RequestRefused(
            401,
            "Missing API key: send it as 'Authorization: Bearer <key>'.",
            code="missing_api_key",
        )
    if authorization[:7].lower() != _BEARER or not authorization[7:].strip():
        raise RequestRefused(
            401, "Malformed Authorization header: expected 'Bearer <key>'.", code="invalid_api_key"
        )
    return authorization[7:].strip()


def may_use(key: ApiKey | None, model: str) -> bool:
    return key is None or key.models is None or model in key.models
