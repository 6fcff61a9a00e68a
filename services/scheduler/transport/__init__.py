"""Everything between the wire and the scheduling policy. The gRPC servicer (``servicer``)
with the frontends' leases (``leases``) and the push of each step's rows to the detokenizer
(``detokenizer_pusher``, which makes each step's protobuf rows); the protobuf codec of
requests and rows (``proto_codec``); and the engine around ``core.Scheduler``:
``EngineCore`` applies commands (``core.commands``) and emits plain outputs, run on a thread
(``engine_thread``) or in its own process over a pipe (``engine_process``, framed by the
generic ``engine_codec``), driven by the RPC side's ``EngineClient`` and wired up from flags
by ``engine_build``; ``metrics`` exports the engine's counts to Prometheus.
"""
