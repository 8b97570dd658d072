"""The job's token: who may call the inference servers and the replay queue.

One random token per launch, in ``AREAL_ASYNC_TOKEN``; sent as ``Authorization: Bearer <token>``
(SGLang's ``--api-key`` scheme; ``/health*`` and ``/ready`` open) or as the queue's first ``Auth``
frame; compared with ``hmac.compare_digest``. Without a token a server or queue serves loopback only
(``require_token``). docs/configuration.md#security.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets

ENV = "AREAL_ASYNC_TOKEN"
HEADER = "Authorization"
# SGLang leaves /health*, /ready (and /metrics) open with --api-key (k8s probes); so does the embedded server
OPEN_PREFIXES = ("/health", "/ready")


def new_token() -> str:
    """A fresh random token: 32 bytes from ``secrets``, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def job_token() -> str | None:
    """The job's token from ``AREAL_ASYNC_TOKEN``, or ``None`` when unset or empty."""
    return os.environ.get(ENV) or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address: ``127.0.0.0/8``, ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def require_token(host: str, token: str | None, what: str) -> None:
    """Raise ``ValueError`` if ``what`` would listen on non-loopback ``host`` without a token."""
    if token is None and not is_loopback(host):
        raise ValueError(f"{what} would listen on {host}, reachable from other machines, without a token; "
                         f"set {ENV}=<secret> (launcher.local makes one per job), or bind 127.0.0.1")


def same(given: str, token: str) -> bool:
    """``given == token`` in time independent of where they differ (``hmac.compare_digest``)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode("utf-8", "surrogateescape"))


def bearer_headers(token: str | None) -> dict[str, str]:
    """The request headers that carry ``token`` (``{}`` for ``None``)."""
    return {HEADER: f"Bearer {token}"} if token else {}


def bearer_ok(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token``, read as SGLang reads it: split at
    the first space, the first part ``bearer`` in any case, the rest equal to ``token``."""
    if not header:
        return False
    parts = header.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and same(parts[1], token)
