"""`python -m dflash_runtime generate | bench | serve | rpc-server` (`main`), and the benchmarks it runs (`bench`,
`bench_concurrency`)."""
