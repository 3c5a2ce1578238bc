"""The status page at /ui in a real headless Chromium (tests/chromium.py), over a gateway with
fake engines behind an admin key: the page asks for the key and shows a wrong one's refusal,
then the fleet as the admin API has it (names and states read from the DOM), a load under way
with its stage, the load and park buttons changing what the page shows, and the engine's log
lines; it keeps the key out of URLs and raises no script error under its strict CSP; the
screenshot it leaves is a PNG. And the page's files and headers without a browser."""

from __future__ import annotations

import json
import struct

import aiohttp
import pytest

from gateway.engines.replica import ReplicaState
from gateway.response_headers import CONTENT_SECURITY_POLICY
from tests.chromium import Chromium, chromium_binary
from tests.gateway.test_residency import fleet, on_demand, states
from tests.gateway.test_resilience import wait_for

S = ReplicaState
ADMIN_KEY = "sk-admin-status-page"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.timeout(90)

ROWS = """Array.from(document.querySelectorAll('#models tbody tr'),
    tr => [tr.dataset.model, tr.querySelector('.model-state').textContent])"""


def state_is(model: str, state: str) -> str:
    return (
        f"document.querySelector('tr[data-model=\"{model}\"] .model-state')"
        f"?.textContent === '{state}'"
    )


@pytest.fixture
async def gateway(pooled, tmp_path, monkeypatch):
    monkeypatch.setenv("STATUS_PAGE_ADMIN_KEY", ADMIN_KEY)
    models = [{"name": "pinned"}, on_demand("od", "--ready-delay-s", "2", idle_ttl_s=600)]
    doc = fleet(tmp_path, models)
    doc["gateway"]["auth"] = {"admin_key_env": "STATUS_PAGE_ADMIN_KEY"}
    gateway, url, _ = await pooled(doc)
    await wait_for(lambda: states(gateway, "pinned") == [S.READY], timeout=15)
    return gateway, url


async def test_the_page_shows_the_fleet_and_its_buttons_act(gateway, tmp_path):
    if chromium_binary() is None:
        pytest.fail("chromium missing: `make test` installs Debian's chromium package")
    gw, url = gateway
    async with Chromium(tmp_path / "browser") as page:
        await page.goto(url + "/ui")
        await page.wait_for("!document.getElementById('login').hidden")
        assert "admin key" in await page.evaluate("document.getElementById('refusal').textContent")

        async def submit(key: str) -> None:
            await page.evaluate(
                f"document.getElementById('key').value = {json.dumps(key)};"
                "document.getElementById('key-form').requestSubmit()"
            )

        await submit("sk-wrong")
        refusal = await page.wait_for(
            "document.getElementById('refusal').textContent.startsWith('Refused') &&"
            " document.getElementById('refusal').textContent"
        )
        assert refusal == "Refused: Incorrect admin key provided."
        assert await page.evaluate("document.getElementById('fleet').hidden")

        await submit(ADMIN_KEY)
        await page.wait_for("!document.getElementById('fleet').hidden")
        await page.wait_for(f'JSON.stringify({ROWS}) === \'[["pinned","ready"],["od","stopped"]]\'')
        assert await page.evaluate("document.getElementById('memory').value") > 0
        # tokens/s as /admin/models reports it
        await page.wait_for(
            "document.querySelector('tr[data-model=pinned] .tokens').textContent === '0.0'"
        )

        await page.evaluate(
            "document.querySelector('button[data-action=load][data-model=od]').click()"
        )
        # before the engine answers, its first phase; then the fake engine's load, under way
        stage = "document.querySelector('[data-replica=\"od#0\"] .stage')?.textContent"
        assert (await page.wait_for(stage)).split(" ")[0] in ("imports", "weights")
        await page.wait_for(f"{stage}.startsWith('weights ')")
        await page.screenshot(tmp_path / "loading.png")
        await page.wait_for(state_is("od", "ready"))
        await page.evaluate(
            "document.querySelector('button[data-action=park][data-model=od]').click()"
        )
        await page.wait_for(state_is("od", "parked"))
        assert states(gw, "od") == [S.PARKED]

        await page.wait_for(
            "document.getElementById('log-lines').textContent.includes('fake engine: loading')"
        )
        assert await page.evaluate("location.href") == url + "/ui"  # the key never in a URL
        assert await page.evaluate("sessionStorage.getItem('modelyard-admin-key')") == ADMIN_KEY
        shot = await page.screenshot(tmp_path / "status-page.png")
        assert page.errors == []
    for png in (shot, tmp_path / "loading.png"):
        data = png.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width == 1280 and height >= 600


async def test_the_page_is_served_without_the_key_and_its_data_only_with_it(gateway):
    _, url = gateway
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/ui") as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
            html = await resp.text()
            headers = resp.headers
        assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        assert "script-src 'self'" in CONTENT_SECURITY_POLICY
        assert "'unsafe-inline'" not in CONTENT_SECURITY_POLICY
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Cache-Control"] == "no-store"
        assert '<script src="/ui/app.js"' in html and "<script>" not in html
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
            async with session.get(f"{url}/ui/{name}") as resp:
                assert resp.status == 200 and resp.content_type == kind
        async with session.get(url + "/ui/secrets.txt") as resp:
            assert resp.status == 404
        async with session.get(url + "/admin/models") as resp:
            assert resp.status == 401 and resp.headers["Cache-Control"] == "no-store"
