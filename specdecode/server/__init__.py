"""OpenAI-compatible HTTP server: routes (app.py), request/response shapes (schemas.py), continuous batching
(scheduler.py over specdecode.batch), Prometheus metrics (metrics.py). `specdecode serve` starts it (cli.py).

Importing this package stays cheap: FastAPI, uvicorn and torch load only when a server is built.
"""
