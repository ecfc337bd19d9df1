"""The HTTP face: the ASGI app, routes per API, the proxy of one request, the client stream.

Knows Starlette; knows nothing of hedge timing (that is `gateway.hedge`).
"""
