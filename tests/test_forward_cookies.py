"""The forwarding client keeps no cookies: what an upstream sets for one client's request
(a provider's load-balancer cookie, a private gateway's session) is never sent upstream with
the next request, whoever's it is. Both transports, over a real socket."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from proxy.adapters.forward import make_client
from proxy.config import parse_config


class _SetsCookies(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[str | None] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).seen.append(self.headers.get("cookie"))
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.send_header("set-cookie", "session=tenant-a; Path=/")
        self.send_header("set-cookie", "__cf_bm=abc; Path=/; Domain=localhost")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
def test_cookies_set_upstream_are_not_sent_back(transport: str) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SetsCookies)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _SetsCookies.seen = []
    port = server.server_address[1]
    upstream = parse_config({"upstream": {"base_url": f"http://localhost:{port}/v1"}}).upstream

    async def run() -> None:
        client = make_client(replace(upstream, transport=transport))
        try:
            for _ in range(3):
                response = await client.post(f"http://localhost:{port}/v1/chat", content=b"{}")
                assert response.status_code == 200
                assert response.headers.get_list("set-cookie")  # relayed, just not kept
        finally:
            await client.aclose()

    try:
        asyncio.run(run())
    finally:
        server.shutdown()
        server.server_close()
    assert _SetsCookies.seen == [None, None, None]
