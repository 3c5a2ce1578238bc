"""An asyncio main in a daemon thread of its own: a client whose clock the caller's own work
must not delay (the victims of bench_attacks and of the structured fuzz)."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    """Runs ``main()`` (a subclass's) in its own thread and event loop until ``stop``; the loops
    in ``main`` end when ``stopping`` is set."""

    join_s = 30.0  # covers a request in flight at stop

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self.main()), daemon=True)

    async def main(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self._thread.is_alive():
            self._thread.join(self.join_s)
