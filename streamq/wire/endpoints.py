"""Where producers are, as a list, a file or a registry names them: read anew at each
call, so producers added join (the Spark source at every trigger, the console at every
poll). Each endpoint is checked to be HOST:PORT before anything connects."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from typing import cast

from .transport import parse_address


class ProviderError(ValueError):
    """A provider that cannot be called; its text follows the provider's option name."""


def listed_endpoints(
    endpoints: str | None, endpoints_file: str | None, provider: str | None = None
) -> list[str]:
    """Endpoints from a comma-separated list, a file with one per line (# comments), and a
    provider: ``module:function`` returning host:port strings (e.g. from a service
    registry), each once, in that order. ``ValueError`` names a bad one, ``ProviderError``
    a provider that cannot be called; ``OSError``, a file that cannot be read."""
    found: list[str] = []
    if endpoints:
        found += _listed(endpoints, lines=False)
    if endpoints_file:
        with open(endpoints_file) as file:
            found += _listed(file.read(), lines=True)
    if provider:
        found += _checked(tuple(str(e).strip() for e in _load_provider(provider)()))
    return list(dict.fromkeys(found))


@functools.lru_cache(maxsize=8)
def _listed(text: str, lines: bool) -> tuple[str, ...]:
    """The endpoints ``text`` lists, comma-separated or (``lines``, a file's) one per line
    with # comments, checked. Parsed once per text: read at every trigger, a thousand
    endpoints checked each time cost an idle trigger milliseconds."""
    parts = [line.split("#", 1)[0] for line in text.splitlines()] if lines else text.split(",")
    return _checked(tuple(part.strip() for part in parts if part.strip()))


def _checked(endpoints: tuple[str, ...]) -> tuple[str, ...]:
    """``endpoints``, once each parses as host:port; else ``ValueError`` naming the bad one."""
    for endpoint in endpoints:
        parse_address(endpoint)
    return endpoints


def _load_provider(spec: str) -> Callable[[], Iterable[str]]:
    module_name, sep, function = spec.partition(":")
    if not sep:
        raise ProviderError(f"must be module:function, not {spec!r}")
    try:
        provider = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise ProviderError(f"{spec!r}: {exc}") from exc
    if not callable(provider):
        raise ProviderError(f"{spec!r} is not callable")
    return cast(Callable[[], Iterable[str]], provider)
