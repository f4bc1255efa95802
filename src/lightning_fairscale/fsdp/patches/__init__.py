"""FairScale 0.4.13's gaps that need no unit of ours (the numbered table of every workaround, with the module that
holds each, is :mod:`.workarounds`): the lowest layer of the FSDP engine, which imports nothing else of it."""
