"""Where a webhook may go: an endpoint's URL and the addresses its host resolves to.

Checked when an endpoint is created (its URL, and its host's addresses when it resolves) and again
before every attempt (the addresses then, which are also the ones connected to: a name that resolved
to a public address at creation and to 127.0.0.1 later is refused then). Loopback, private, link-local,
shared, multicast, reserved and unspecified addresses are refused unless an operator's allow-list
(``LLMBATCH_WEBHOOKS__ALLOW_NETWORKS``) holds them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from llmbatch.dispatcher.errors import PermanentError, TransientError
from llmbatch.schemas.webhooks import MAX_URL_LENGTH
from llmbatch.settings.webhooks import IpNetwork

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class TargetRefused(PermanentError):
    """An endpoint URL or address that webhooks may not target (the message names why and the fix)."""

    code = "webhook_target_refused"


class TargetUnresolved(TransientError):
    """The endpoint's host name did not resolve (now)."""

    code = "webhook_target_unresolved"


@dataclass(frozen=True, slots=True)
class Target:
    """A checked endpoint URL, split."""

    scheme: str
    host: str
    port: int
    path: str  # path and query, as sent

    @property
    def literal_ip(self) -> IpAddress | None:
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None


def check_url(url: str, *, allow_http: bool) -> Target:
    """``url`` split, or :class:`TargetRefused` naming what is wrong with it."""
    if len(url) > MAX_URL_LENGTH or any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise TargetRefused(f"url must be at most {MAX_URL_LENGTH} characters without spaces or controls")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetRefused(f"url is not a URL: {exc}") from exc
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes:
        raise TargetRefused(f"url must start with {' or '.join(s + '://' for s in schemes)}")
    if not parts.hostname:
        raise TargetRefused("url has no host")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("url must not carry credentials (user:password@): the signature authenticates")
    if parts.fragment:
        raise TargetRefused("url must not have a #fragment")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    default = 443 if parts.scheme == "https" else 80
    return Target(parts.scheme, parts.hostname, port or default, path)


def check_address(address: IpAddress, allowed: Sequence[IpNetwork]) -> None:
    """:class:`TargetRefused` unless ``address`` is public or in an allowed network."""
    plain = (
        address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped else address
    )
    if any(plain in net for net in allowed):
        return
    if not plain.is_global or plain.is_multicast or plain.is_reserved or plain.is_unspecified:
        raise TargetRefused(
            f"{address} is not a public address (loopback, private, link-local or reserved): webhooks go "
            "there only if an operator lists its network in LLMBATCH_WEBHOOKS__ALLOW_NETWORKS"
        )


async def resolve(target: Target, allowed: Sequence[IpNetwork]) -> IpAddress:
    """The address to connect to: every address the host resolves to must pass
    :func:`check_address` (a name with one private address among public ones is refused)."""
    literal = target.literal_ip
    if literal is not None:
        check_address(literal, allowed)
        return literal
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            target.host, target.port, type=socket.SOCK_STREAM
        )
    except (OSError, UnicodeError) as exc:
        raise TargetUnresolved(f"{target.host} did not resolve: {exc}") from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos]
    if not addresses:
        raise TargetUnresolved(f"{target.host} resolved to no address")
    for address in addresses:
        check_address(address, allowed)
    return addresses[0]
