"""HTTP control routes for a worker (the optional ``[http]`` extra: fastapi, uvicorn, httpx).

``store.http.routes`` needs fastapi, ``store.http.client`` only httpx; importing this package
imports neither.
"""
