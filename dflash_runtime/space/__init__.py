"""The Space's own modules, apart from the runtime's core: presets and run mode, requests and their limits, fitting a
conversation in the context, Hub downloads, the native build's start-up check, the text views, and the engine host.

Nothing here imports gradio, and nothing touches CUDA at import time, so the web process can use all of it.
"""
