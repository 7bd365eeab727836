"""Request-size guard (pure ASGI): refuse bodies over a limit with 413 before they are read or parsed."""

from __future__ import annotations

import json


class BodySizeGuard:
    """``limits``: path -> max body bytes (others get ``default``); checks Content-Length, then counts chunks."""

    def __init__(self, app, limits: dict[str, int], default: int):
        self.app, self.limits, self.default = app, limits, default

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.get(scope["path"], self.default)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _refuse(send, limit)
        seen, started, refused = 0, False, False

        async def counting_receive():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit and not started:  # answer now; the app then sees a disconnected client
                    refused = True
                    await _refuse(send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if refused:
                return  # our 413 is already out: drop whatever the app answers to the disconnect
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, guarded_send)


async def _refuse(send, limit: int) -> None:
    body = json.dumps({"error": f"request body is over the limit of {limit} bytes"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
