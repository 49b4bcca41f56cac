"""`specmoe serve`: an OpenAI-compatible HTTP server over an `LLM` (the `[serve]` extra).

Importing this package needs nothing beyond specmoe's own dependencies; `specmoe.serve.app`
imports FastAPI, uvicorn's ASGI stack, prometheus-client and jinja2 (pip install 'specmoe[serve]').

- `config`: `ServeConfig`, the server's settings.
- `engine`: `AsyncEngine`, the engine loop thread around `EngineCore` (continuous batching,
  aborts, the bounded waiting queue, per-request timeouts) and its asyncio bridge.
- `protocol`: OpenAI request bodies → checked generation requests; `OpenAIError`.
- `responses`: OpenAI response and stream-chunk bodies, incremental text.
- `chat`: the model's chat template, rendered with jinja2 as transformers does.
- `metrics`: the Prometheus registry behind `/metrics`.
- `app`: `build_app(llm, config)`, the ASGI application.
"""
