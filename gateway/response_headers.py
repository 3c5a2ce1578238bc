"""Headers on every answer of the status page and the admin API it calls (``/ui``, ``/admin``):
admin data is never cached (by the browser or a proxy), and the page runs only its own script
and style (no inline code, no other origin, no framing), so injected markup could not run or
send the admin key anywhere."""

from __future__ import annotations

from aiohttp import web

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: refusals and streams included."""
    if request.path.startswith(("/ui", "/admin")):
        for name, value in _HEADERS.items():
            response.headers.setdefault(name, value)
