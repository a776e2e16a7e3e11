"""What a sequence holds and how it goes back: the pair's cache of one sequence (`pair_cache`), a hybrid target's
checkpoints, and the cache owners parked beside the running ones (`sessions`)."""
