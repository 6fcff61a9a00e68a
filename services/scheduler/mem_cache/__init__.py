"""KV memory: the pool of per-token KV slots (``kv_pool``), the radix prefix cache over
them (``radix_cache``), and ``kv_cache.KVCacheManager``, which gives a sequence its slots,
matches and inserts its prefix and frees what it held. It knows sequences only through the
narrow protocol it declares, never the scheduler's ``Req``.
"""
