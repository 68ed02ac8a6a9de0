"""OpenAI-compatible HTTP server (FastAPI + uvicorn) and the `specserve` command line.

The server imports the engine, never the reverse. Import `specserve.server.api` for the app
factory (`build_app`) and `specserve.server.cli` for `main()`; this package itself stays light so
that `specserve generate` does not pay for the web stack.
"""
