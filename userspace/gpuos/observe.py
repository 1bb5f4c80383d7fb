"""What long operations tell whoever watches them: phase changes and byte progress."""

from __future__ import annotations

from typing import Callable, Protocol

Progress = Callable[[int], None]  # called with a number of bytes just processed


class Observer(Protocol):
    def phase(self, name: str) -> None: ...
    def bytes_progress(self, label: str, total: int) -> Progress | None: ...


class Silent:
    def phase(self, name: str) -> None:
        pass

    def bytes_progress(self, label: str, total: int) -> Progress | None:
        return None
