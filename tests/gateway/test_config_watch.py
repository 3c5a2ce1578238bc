"""Reloading models.yaml when it changes on disk (gateway/config_watch.py)."""

from __future__ import annotations

import yaml

from gateway import config_watch
from tests.gateway.conftest import fleet
from tests.gateway.test_resilience import wait_for


async def test_reload_on_file_change(start_gateway, fresh_upstreams, monkeypatch):
    monkeypatch.setattr(config_watch, "CONFIG_POLL_S", 0.05)
    gw = await start_gateway(fleet([fresh_upstreams[0].url], watch_config=True))
    doc = fleet([fresh_upstreams[0].url], watch_config=True)
    doc["models"][0]["aliases"] = ["default", "renamed"]
    gw.path.write_text(yaml.safe_dump(doc))
    await wait_for(lambda: gw.gateway.router.resolve("renamed") is not None, timeout=3.0)
    assert (await gw.chat("renamed")).status == 200


async def test_watcher_waits_until_the_file_is_written(start_gateway, fresh_upstreams, monkeypatch):
    """An editor's write in two pieces, with the watcher polling in between: one reload, of the
    whole file, and no rejection of the half."""
    polls = 0
    stamp = config_watch.file_stamp

    def counted_stamp(path):
        nonlocal polls
        polls += 1
        return stamp(path)

    async def next_poll() -> None:
        seen = polls
        await wait_for(lambda: polls > seen, timeout=2.0)

    monkeypatch.setattr(config_watch, "file_stamp", counted_stamp)
    monkeypatch.setattr(config_watch, "CONFIG_POLL_S", 0.05)
    upstream = fresh_upstreams[0].url
    gw = await start_gateway(fleet([upstream], watch_config=True))
    reloads = gw.gateway.metrics.config_reloads
    doc = fleet([upstream], watch_config=True)
    doc["models"][0]["aliases"] = ["default", "renamed"]
    text = yaml.safe_dump(doc)
    cut = text.index("upstreams:") + 4  # the first half is not a valid models.yaml
    await next_poll()
    with gw.path.open("w") as file:
        file.write(text[:cut])
        file.flush()
        await next_poll()  # the watcher has seen the half-written file
        file.write(text[cut:])
    await wait_for(lambda: gw.gateway.router.resolve("renamed") is not None, timeout=3.0)
    for _ in range(3):
        await next_poll()
    assert reloads.labels("applied")._value.get() == 1
    assert reloads.labels("rejected")._value.get() == 0
