"""Small facts about network addresses."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bracketed(host: str) -> str:
    """``host`` as it stands before ``:port`` in an address or a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def host_port(host: str, port: int | str) -> str:
    """``host:port``, ``[v6]:port`` for an IPv6 address (what :func:`split_host_port` reads back)."""
    return f"{bracketed(host)}:{port}"


def split_host_port(text: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]:port`` or a bare IPv6 address → (host, port).

    Raises ValueError with a message that says what is wrong.
    """
    text = text.strip()
    if not text:
        raise ValueError("empty address")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"{text!r}: missing ']' after an IPv6 address")
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected ':PORT' after ']'")
        port_text = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:  # a name, an IPv4 address, or a bare IPv6 address
        host, port_text = text, ""
    if not host:
        raise ValueError(f"{text!r}: no host")
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"{text!r}: port must be a number from 1 to 65535")
        return host, int(port_text)
    return host, default_port
