"""FairScale 0.4.13's gaps, one module per workaround (the numbered table in :mod:`.workarounds`): the lowest
layer of the FSDP engine, which imports nothing else of it."""
