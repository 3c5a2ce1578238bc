"""The engine as an OpenAI-compatible HTTP server.

- `cli`, `options`: `python -m engine`'s command line -> EngineConfig + ServerOptions.
- `server`: the process: bind, load the model, serve, drain on SIGTERM.
- `app`: the HTTP API (routes, handlers, OpenAI error shape).
- `requests` (with `request_fields`, `prompts`): request bodies -> SamplingParams + prompt ids.
- `responses`: output deltas -> OpenAI chunks and response bodies.
- `async_engine`: the bridge from the event loop to the engine thread (`engine_thread`, which
  applies `commands` between steps), with sleep and wake (`sleep_switch`) and each request's
  latencies (`request_stats`).
- `errors`: what only the server raises (503, 404, 500); `metrics`: vLLM-named Prometheus metrics.

Imports engine.core (never engine.model directly); torch loads only when `server` starts the core.
"""
