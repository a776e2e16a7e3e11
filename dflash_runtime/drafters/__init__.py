"""The draft methods' implementations behind one protocol (`drafting`): DFlash / DFlash 2 and its tree, MTP,
EAGLE-3, draft-simple, the n-gram drafts; a request's method list (`method_list`). The registry
(`dflash_runtime.methods`) names them."""
