"""An engine's log file (gateway/engines/logs.py): rotated by size within ``files × max_bytes``,
its tail read back across the rotated files (whole lines only), followers fed every line once
across rotations and bounded when they fall behind, a folder that cannot be written warned about
once; and where each replica's file is."""

from __future__ import annotations

import logging

from gateway.config.schema import EngineLogSettings
from gateway.engines import logs as logs_module
from gateway.engines.logs import EngineLog, EngineLogs

LINE = "x" * 40  # 41 bytes with its newline: 24 to a 1 KiB file


def lines(count: int, start: int = 0) -> list[str]:
    return [f"{i:06d} {LINE}" for i in range(start, start + count)]


def test_rotation_keeps_files_times_max_bytes_and_the_newest_lines(tmp_path):
    log = EngineLog(tmp_path / "replica-0.log", 1024, 3)
    for line in lines(200):
        log.write(line)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["replica-0.log", "replica-0.log.1", "replica-0.log.2"]
    assert all(p.stat().st_size <= 1024 for p in tmp_path.iterdir())
    kept = [
        *(tmp_path / "replica-0.log.2").read_text().splitlines(),
        *(tmp_path / "replica-0.log.1").read_text().splitlines(),
        *(tmp_path / "replica-0.log").read_text().splitlines(),
    ]
    assert kept == lines(200)[-len(kept) :] and len(kept) > 2 * 20
    # a tail longer than the live file reads on in the rotated ones, in order
    assert log.tail(50) == lines(200)[-50:]
    assert log.tail(1000) == kept
    assert log.tail(0) == []


def test_one_file_keeps_no_rotated_copy(tmp_path):
    log = EngineLog(tmp_path / "t.log", 1024, 1)
    for line in lines(100):
        log.write(line)
    assert [p.name for p in tmp_path.iterdir()] == ["t.log"]
    assert log.tail(5) == lines(100)[-5:]


def test_a_restarted_gateway_appends_to_the_file_and_rotates_by_its_size(tmp_path):
    EngineLog(tmp_path / "t.log", 1024, 2).write("before the restart")
    log = EngineLog(tmp_path / "t.log", 1024, 2)
    log.write("after")
    assert log.tail(5) == ["before the restart", "after"]
    for line in lines(30):
        log.write(line)
    assert (tmp_path / "t.log.1").exists() and (tmp_path / "t.log").stat().st_size <= 1024


def test_a_tail_cut_by_its_byte_budget_has_whole_lines_only(tmp_path, monkeypatch):
    monkeypatch.setattr(logs_module, "TAIL_MAX_BYTES", 100)
    monkeypatch.setattr(logs_module, "_READ_BLOCK", 30)
    log = EngineLog(tmp_path / "t.log", 2**20, 2)
    for line in lines(10):
        log.write(line)
    found = log.tail(10)
    assert found == lines(10)[-len(found) :] and 1 <= len(found) < 3


async def test_followers_get_every_line_once_across_rotations(tmp_path):
    log = EngineLog(tmp_path / "t.log", 1024, 2)
    follower = log.follow()
    for line in lines(300):
        log.write(line)
    assert await follower.next_lines(1.0) == lines(300)
    assert await follower.next_lines(0.01) == []  # nothing new: it waited, then none
    log.unfollow(follower)
    log.write("after")
    assert await follower.next_lines(0.01) == []


async def test_a_follower_that_falls_behind_holds_a_bounded_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(logs_module, "FOLLOW_BUFFER_LINES", 10)
    log = EngineLog(tmp_path / "t.log", 2**20, 1)
    follower = log.follow()
    for line in lines(25):
        log.write(line)
    assert await follower.next_lines(0.1) == lines(10)
    assert follower.dropped == 15
    follower.close()
    assert follower.closed and await follower.next_lines(5.0) == []  # at once


async def test_a_folder_that_cannot_be_written_is_warned_about_once(tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    log = EngineLog(tmp_path / "a-file" / "t.log", 1024, 2)
    follower = log.follow()
    with caplog.at_level(logging.WARNING, "modelyard.pool"):
        log.write("one")
        log.write("two")
    assert [r.getMessage().startswith("cannot write the engine log") for r in caplog.records] == [
        True
    ]
    assert await follower.next_lines(0.1) == ["one", "two"] and log.tail(5) == []


def test_each_replica_and_template_has_its_own_file(tmp_path):
    logs = EngineLogs(EngineLogSettings(), tmp_path)
    one = logs.replica("org/model:7b", 1)
    assert one.path == tmp_path / "models" / "org%2Fmodel%3A7b" / "replica-1.log"
    assert logs.replica("org/model:7b", 1) is one  # kept: its followers stay with it
    assert logs.replica("org/model:7b", 0) is not one
    assert logs.template("passive").path == tmp_path / "templates" / "passive.log"
    assert (one.max_bytes, one.files) == (10 * 2**20, 3)
