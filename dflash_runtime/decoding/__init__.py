"""A request's speculative decoding on the engine: its keywords checked (`checks`), its sequence held (`occupancy`:
who may use the engine now), its phases (`request`), one step for every running request (`steps`), its draft
length (`controller`), its drafts verified (`verify`), and a temperature-0 difference explained (`divergence`)."""
