"""Where generation runs (the GPU worker on ZeroGPU): the GPU function and the engine host it keeps."""
