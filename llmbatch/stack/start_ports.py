"""The ports one start of a local service takes (from the stack's one allocator,
:mod:`llmbatch.stack.ports`): handed to the service's PID once it runs, given back if the start fails."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from llmbatch.stack.ports import PortAllocator, allocator
from llmbatch.stack.process import StackError


class StartPorts:
    """The ports one start takes: handed to the service's PID once it runs, given back on failure."""

    def __init__(self, ports: PortAllocator) -> None:
        self._ports = ports
        self.held: list[int] = []

    def one(self) -> int:
        port = self._ports.port()
        self.held.append(port)
        return port

    def block(self, size: int) -> int:
        first = self._ports.port_range(size)
        self.held.extend(range(first, first + size))
        return first

    def claim(self, port: int) -> bool:
        ok = self._ports.claim(port)
        if ok:
            self.held.append(port)
        return ok

    def again(self, service: str, ports: dict[str, int], *names: str) -> list[int]:
        """Claim the ports ``names`` a restarted ``service`` had (from its record), or raise."""
        for name in names:
            if not self.claim(ports[name]):
                raise StackError(
                    f"{service} cannot restart on port {ports[name]}: something already listens "
                    "there or another process reserved it"
                )
        return [ports[name] for name in names]

    def hand_over(self, pid: int) -> None:
        self._ports.hand_over(self.held, pid)

    def give_back(self) -> None:
        """Only reservations of this process or of a service that died go: a service that is still
        up (a health timeout) keeps its ports until it is stopped."""
        self._ports.release(self.held)


@contextlib.contextmanager
def start_ports() -> Iterator[StartPorts]:
    """The ports of one start: given back when the start raises."""
    ports = StartPorts(allocator())
    try:
        yield ports
    except BaseException:
        ports.give_back()
        raise
