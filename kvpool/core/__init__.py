"""The KV cache manager: pure Python (no torch, no engine, no I/O).

Blocks and their free queue, block hashing, block pools for the device and host tiers, one manager
per layer type, and the `KVCacheManager` the scheduler talks to.
"""
