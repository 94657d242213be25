"""The Responses API's stored responses: OpenAI's ``store`` (true unless a request says false),
kept in this server's memory for ``previous_response_id``, ``GET`` and ``DELETE``.

Each entry is a response and the conversation it ended, as chat messages (its input, after the
conversation of the response it continued, then its own answer), so a request naming it goes on
from there. At most ``max_entries`` are kept, the least recently used dropped first; a restart
forgets them all. ``max_entries`` 0 stores nothing (``store`` is then answered false).
"""
from __future__ import annotations

import collections
import threading

DEFAULT_MAX_STORED_RESPONSES = 1024


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES):
        if max_entries < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._entries[response["id"]] = (response, conversation)
            self._entries.move_to_end(response["id"])
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None
