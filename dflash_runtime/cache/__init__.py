"""What a sequence holds and how it goes back: the pair's cache of one sequence (`pair_cache`), a hybrid target's
checkpoints, the spare sequences a draft tree's paths borrow (`spares`), and the cache owners parked beside the
running ones (`sessions`)."""
