"""Device runtime: PJRT client, memory (DLPack storages), transfers, RNG, device module."""
