"""The FSDP unit: FairScale's ``FullyShardedDataParallel`` as this package builds it (:mod:`.units`), and what
it knows about its parameters between steps. Imports only :mod:`lightning_fairscale.fsdp.patches` of the engine."""
