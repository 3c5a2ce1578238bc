"""Typed keys for what middlewares and handlers store on a request."""

from __future__ import annotations

from aiohttp import web

from gateway.config import ApiKey
from gateway.proxy import Exchange

REQUEST_ID = web.RequestKey("request_id", str)
API_KEY = web.RequestKey("api_key", ApiKey | None)  # None in open mode
MODEL = web.RequestKey("model", str)  # canonical name once routed (a bounded metrics label)
EXCHANGE = web.RequestKey("exchange", Exchange)
