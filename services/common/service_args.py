"""The services' command lines (``python -m services.{control,data,store,worker}``), checked
before anything starts: a bad flag or environment value is one line on stderr that names the
flag and its environment variable, exit status 2, and no process, port or file left behind.

The value types are argparse ``type=`` functions (argparse applies them to a string default
too, so a value from the environment is checked as one from the flag); each is made for one
environment variable, so that its error says where a value may have come from.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import sys
from collections.abc import Callable
from typing import NoReturn

# RFC 1123 host names: labels of letters, digits and hyphens, not starting or ending with a
# hyphen; and underscores, which some clusters' node names carry (resolved from /etc/hosts).
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


class ServiceArgumentParser(argparse.ArgumentParser):
    """argparse with its errors on one line (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _from(env: str) -> str:
    return f" (the flag or {env})" if env else ""


def port(env: str = "") -> Callable[[str], int]:
    """A TCP port, 0-65535 (0: the kernel picks a free one)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if not 0 <= value <= 65535:
            raise argparse.ArgumentTypeError(f"expected a port number 0-65535{_from(env)}, got {text!r}")
        return value

    return parse


def seconds(env: str = "") -> Callable[[str], float]:
    """A finite number of seconds >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0{_from(env)}, got {text!r}")
        return value

    return parse


def valid_host(text: str) -> bool:
    """An IP address (IPv6 with or without brackets) or an RFC 1123 host name."""
    try:
        ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
        return True
    except ValueError:
        pass
    name = text.removesuffix(".")
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in name.split("."))


def host(env: str = "", *, wildcard: bool = False) -> Callable[[str], str]:
    """A host name or address; ``wildcard``: also "" / 0.0.0.0 / :: (listen on every address)."""

    def parse(text: str) -> str:
        if (wildcard and text in ("", "0.0.0.0", "::", "[::]")) or valid_host(text):
            return text
        raise argparse.ArgumentTypeError(f"expected a host name or IP address{_from(env)}, got {text!r}")

    return parse


def listen_host(env: str = "") -> Callable[[str], str]:
    """The address a service listens on: a host, or a wildcard (every address)."""
    return host(env, wildcard=True)


def env_option(
    parser: argparse.ArgumentParser,
    flag: str,
    var: str,
    kind: Callable[[str], Callable[[str], object]],
    default: str | None = None,
    help: str = "",
) -> None:
    """``flag``; without it the value of environment variable ``var``, else ``default``;
    checked by ``kind(var)`` (so that its error names the variable too)."""
    text = f"{help}; env {var}" if help else f"env {var}"
    parser.add_argument(flag, type=kind(var), default=os.environ.get(var) or default, help=text)


def address(env: str = "") -> Callable[[str], str]:
    """``HOST:PORT`` of a service, the port 1-65535 (IPv6 in brackets: ``[::1]:50051``)."""

    def parse(text: str) -> str:
        name, sep, number = text.rpartition(":")
        if sep and valid_host(name) and number.isdigit() and 1 <= int(number) <= 65535:
            return text
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 1-65535{_from(env)}, got {text!r}")

    return parse
