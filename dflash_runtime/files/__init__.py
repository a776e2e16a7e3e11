"""Model files before libllama opens them: what a GGUF header says (`gguf_meta`), whether a draft fits its target
(`validation`), a file from a path or the Hub (`hub`), and what each sequence of a pair costs in memory
(`footprint`)."""
