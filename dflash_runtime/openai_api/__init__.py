"""The OpenAI-compatible HTTP API: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`.

`fields` checks a request body into an `ApiRequest` (one clear 400 per bad field), `shapes` builds the responses and
stream chunks (OpenAI's objects, llama-server's `timings` and the engine's figures under `dflash_stats`), `thinking`
splits a thinking model's text into `reasoning_content` and `content`, `server` is the ASGI application over a
`Backend` (what answers), `engine_backend` the backend of one loaded engine (`python -m dflash_runtime serve`). The
Space mounts the same application over its own backend (dflash_runtime.space.web.openai_routes).
"""
