"""The scheduler: the engine loop behind the HTTP server, in one thread of its own.

Checked requests (`Prepared`) arrive on a thread-safe inbox. The loop groups the waiting ones by cartridge set into
batches (`Server.plan`) and keeps up to `max_active` batches running at once, advancing each by one unit (a
prefill chunk or a decode step) in turn: a long prompt's prefill is interleaved with the decode steps of the
batches already running, and a request that arrives while others run starts without waiting for them to end.
Requests wait `window_s` before their batch is formed, so a burst of them lands in one batch. A request whose
client went away (`Prepared.cancel`) is dropped while it waits, and stops at its batch's next unit once running.
Events reach the caller through the `notify(tag, value)` it submitted: ("delta", text), then ("done",
Completion) or ("error", exception); they are called from the engine thread.
"""

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from cartridges.engine.requests import Prepared
from cartridges.engine.server import BatchRun, Server

log = logging.getLogger(__name__)

Notify = Callable[[str, Any], None]


class Scheduler:
    def __init__(self, server: Server, window_s: float = 0.005, max_active: int = 4):
        self.server, self.window_s, self.max_active = server, window_s, max_active
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="cartridges-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, prepared: Prepared, notify: Notify) -> None:
        """Queue a checked request; its events arrive through `notify`."""
        self._inbox.put((prepared, notify, time.monotonic()))

    def _loop(self) -> None:
        active: list[tuple[BatchRun, list]] = []
        waiting: list = []  # (prepared, notify, arrival)
        while True:
            if not self._take(waiting, block=not active and not waiting):
                break
            waiting = [item for item in waiting if not item[0].cancelled]
            ready = waiting and time.monotonic() - waiting[0][2] >= self.window_s
            if ready and len(active) < self.max_active:
                batches = self.server.plan(list(enumerate(item[0] for item in waiting)))
                taken = set()
                for batch in batches[: self.max_active - len(active)]:
                    items = [waiting[i] for i, _ in batch]
                    taken.update(i for i, _ in batch)
                    run = BatchRun(self.server, [p for _, p in batch], self._on_event(items), list(range(len(items))))
                    active.append((run, items))
                waiting = [item for i, item in enumerate(waiting) if i not in taken]
            elif not active and waiting:
                time.sleep(max(0.0, self.window_s - (time.monotonic() - waiting[0][2])))
            for entry in list(active):
                run, items = entry
                try:
                    done = run.advance()
                except Exception as e:  # the batch is over: answer its requests, keep serving the others
                    self.server.failed(e, len(items))
                    active.remove(entry)
                    for _, notify, _ in items:
                        _send(notify, "error", e)
                    continue
                if done:
                    active.remove(entry)
                    for (_, notify, _), completion in zip(items, run.results):
                        _send(notify, "done", completion)
        for run, _ in active:
            run.close()

    def _take(self, waiting: list, block: bool) -> bool:
        """Move what the inbox holds to `waiting` (waiting for a first item when `block`); False on stop."""
        try:
            item = self._inbox.get() if block else self._inbox.get_nowait()
            while True:
                if item is None:
                    return False
                waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    @staticmethod
    def _on_event(items: list):
        def on_event(index: int, delta: str, completion) -> None:
            if delta:
                _send(items[index][1], "delta", delta)

        return on_event


def _send(notify: Notify, tag: str, value) -> None:
    try:
        notify(tag, value)
    except Exception:  # a caller that cannot take events (its loop closed) must not stop the engine
        log.exception("could not deliver a %s event", tag)
