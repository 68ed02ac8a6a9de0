"""OpenAI-compatible HTTP server (`api.build_app`) and the `specserve` command line (`cli.main`). The server
imports the engine, never the reverse; this package stays light so `specserve generate` skips the web stack."""
