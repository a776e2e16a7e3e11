"""The foundation: libllama and ggml through owning wrappers — the backends, the DFlash ext bindings (`ext`),
batches, the vocabulary, the request's sampler (`sampling`), sequence memory and states, the RPC devices and where
layers live."""
