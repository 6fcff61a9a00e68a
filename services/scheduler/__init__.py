"""The scheduler service, laid out by layer; each layer imports only the ones below it
(import-linter checks this in ``make lint``):

* ``transport``: the gRPC servicer, the engine core and the ways to run it, protobuf;
* ``core``: the scheduling policy (``Scheduler``) and the request state it owns;
* ``model_executor``: the model forward (runner, batch, attention backends, ``models``);
* ``sampling`` and ``mem_cache``: picking tokens from logits; the KV pool and prefix cache;
* ``ops``: the C++ kernels and their one loader.
"""
