"""The Space's own modules, apart from the runtime's core.

Web process: `service` (configuration, request checks, GPU jobs, /info) with `requests` (limits and field checks),
`runmode` (offline demo or the configured pair, and the GPU-build check), `presets`, `downloads` (Hub), `gpu_time`
(ZeroGPU durations from measured speeds), `jobs` (a GPU call as a cancellable job), `session` (a tab's conversation),
`views` (text shown), `startup` (the native build's self-check), `callers` (the HTTP gate, ASGI middleware:
bounded bodies, no uploads, limits on queued answers, and no answer runs that nobody reads) and `endpoints` (the
API and page handlers: the one module that imports gradio).
Where generation runs: `zerogpu` (the GPU function) and `host` (the engine host, with `fitting`). Nothing here
touches CUDA at import time, so the web process can import all of it.
"""
