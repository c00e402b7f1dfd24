"""Host-side memo shared by the launch path (no GPU or DSL imports: ``validate`` uses it too)."""

from __future__ import annotations

from typing import Any


class HostMemo:
    """A bounded dict for host-side work repeated on every call with the same metadata (configs
    built from the inputs, checks they passed): a training step calls each attention op with the
    same shapes, and rebuilding in Python costs tens of microseconds per call. The oldest entry
    goes once ``maxsize`` is passed."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: dict = {}

    def get(self, key: Any, default: Any = None) -> Any:
        return self._data.get(key, default)

    def __contains__(self, key: Any) -> bool:
        return key in self._data

    def put(self, key: Any, value: Any = None) -> None:
        self._data[key] = value
        if len(self._data) > self.maxsize:
            del self._data[next(iter(self._data))]
