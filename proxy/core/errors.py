"""The proxy's exception tree, mapped to OpenAI-shaped errors in one place (the server)."""

from __future__ import annotations


class ProxyError(Exception):
    """Base of every error the proxy raises on purpose."""

    status = 500
    type = "server_error"
    code: str | None = "proxy_error"
    # x-should-retry on our error responses; None: retry 5xx, never 4xx.
    retry: bool | None = None


class BadRequest(ProxyError):
    """The client's request is malformed: not JSON, wrong types, missing fields."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class PayloadTooLarge(BadRequest):
    """The request body is over ``limits.max_body_mb``."""

    status = 413
    code = "request_too_large"


class BodyTimeout(BadRequest):
    """The client did not finish sending its body within ``limits.body_timeout_s``. Nothing
    was forwarded, so the client may send it again."""

    status = 408
    code = "request_timeout"
    retry = True


class ContextTooLong(BadRequest):
    """Even compacted, the request is over the model's context window: nothing can be dropped."""

    code = "context_length_exceeded"


class NotFound(ProxyError):
    """No such route."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class Unauthorized(ProxyError):
    """The admin token is missing or wrong."""

    status = 401
    type = "authentication_error"
    code = "invalid_admin_token"


class UpstreamError(ProxyError):
    """The upstream could not be used."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"


class UpstreamUnavailable(UpstreamError):
    """The upstream refused the connection or the network failed."""

    code = "upstream_unavailable"


class UpstreamUnreachable(UpstreamUnavailable):
    """The upstream's host name does not resolve or its port refuses connections: the same
    request fails the same way until the configuration or the upstream changes, so clients
    are told not to retry (``x-should-retry: false``)."""

    code = "upstream_unreachable"
    retry = False


class UpstreamTimeout(UpstreamError):
    """The upstream did not answer within ``upstream.timeout_s``."""

    status = 504
    code = "upstream_timeout"


class CompactionFailed(Exception):
    """The detector or summarizer failed; never surfaces to the client (the proxy fails open)."""


class CallRefused(CompactionFailed):
    """The upstream refused a call in the client's shape (a 4xx) or answered it in another
    shape: the standalone call may still succeed. A 5xx, a timeout or an unreachable upstream
    is a plain ``CompactionFailed``: another call now would fail alike."""


class StoreError(Exception):
    """The store is unavailable (disk full, corrupt database, lost connection)."""
