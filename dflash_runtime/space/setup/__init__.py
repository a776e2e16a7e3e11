"""What the Space is started with: the native build's self-check, the run mode, the presets, the pair's downloads and
the environment's settings."""
