"""The Space's own modules, apart from the runtime's core, laid out by the way a message travels.

`setup/`: what the Space is started with (the native build's self-check `startup`, the run mode `runmode`, the
`presets`, the pair's `downloads` from the Hub, and `settings`, the table of the public layer's settings).
`page/`: the page and the API (`endpoints`, the one module that imports gradio, with `session`, a tab's
conversation, and the text it shows: `views`, `panel`, `highlight`, `speedup`).
`web/`: the web side of a GPU call (`service`: request checks, GPU jobs, /info; `policy`, the one fair-share policy,
pure, and `calls`, it under a lock; `gate`, the HTTP gate; `jobs`, a GPU call as a cancellable job; `clients`,
`probes`, `gpu_time`, `openai_routes`).
`gpu/`: where generation runs (`zerogpu`, the GPU function, and `host`, the engine host, with `fitting`).
Between them, plain data both processes share: `gpu_job` (the job and its reply chunks), `requests` (a checked
request), `provenance` (who wrote a reply), `scrub` (paths cut from what a visitor reads). The web side imports
nothing of `gpu/`, which imports nothing of the page: app.py hands the GPU function to the service. Nothing here
touches CUDA at import time, so the web process can import all of it.
"""
