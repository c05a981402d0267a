"""Liveness and readiness probes: ``/healthz`` and ``/readyz`` (issue #13).

They read the store's health (``proxy.adapters.health.StoreHealth``) that the service owns.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.adapters.health import StoreHealth


def _health(request: Request) -> StoreHealth:
    health: StoreHealth = request.app.state.res.health
    return health


async def healthz(request: Request) -> Response:
    """Liveness: the process answers. ``degraded`` while the store is unusable."""
    problem = _health(request).problem
    if problem is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "degraded", "store": problem})


async def readyz(request: Request) -> Response:
    """Readiness: the store answers a write and a read now (checked on each call); a store
    that was recreated while running says when and why (``store_recreated``)."""
    health = _health(request)
    problem = await health.check()
    # A store found deleted or replaced and opened again says so (issue #29): its records
    # from before are gone, which an operator should know even though it is ready again.
    recreated = {"store_recreated": health.recreated} if health.recreated else {}
    if problem is None:
        return JSONResponse({"status": "ready", **recreated})
    return JSONResponse({"status": "unavailable", "store": problem, **recreated}, status_code=503)
