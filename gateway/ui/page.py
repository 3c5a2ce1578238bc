"""The status page's three files, read from the package once and served as they are: no build
step, nothing fetched from elsewhere, so it works offline. They hold no data (the script fetches
it from ``/admin/*`` with the admin key), so they are served to anyone; their headers are
gateway/response_headers.py's."""

from __future__ import annotations

from importlib.resources import files

from aiohttp import web

_STATIC = files(__package__).joinpath("static")
PAGE_PATH = "/ui"
# file name -> (its bytes, Content-Type)
_FILES = {
    name: (_STATIC.joinpath(name).read_bytes(), content_type)
    for name, content_type in (
        ("index.html", "text/html; charset=utf-8"),
        ("app.js", "text/javascript; charset=utf-8"),
        ("style.css", "text/css; charset=utf-8"),
    )
}


async def page(request: web.Request) -> web.Response:
    return _serve("index.html")


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _FILES or name == "index.html":
        raise web.HTTPNotFound()
    return _serve(name)


def add_routes(app: web.Application) -> None:
    app.router.add_get(PAGE_PATH, page)
    app.router.add_get(PAGE_PATH + "/", page)
    app.router.add_get(PAGE_PATH + "/{name}", asset)


def _serve(name: str) -> web.Response:
    body, content_type = _FILES[name]
    return web.Response(body=body, headers={"Content-Type": content_type})
