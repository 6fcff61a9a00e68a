"""The scheduling policy and the state it owns, with no transport and no protobuf.
``scheduler.Scheduler`` admits from the waiting queue (``waiting_queue``), plans each
forward, samples and commits, with ``overlap`` launching the next decode before committing
the one in flight. It owns each request's state (``req.Req``), ends requests
(``stop_checker``), keeps sessions' KV alive between turns (``sessions``), counts what it
did (``stats``) and emits ``output_row.OutputRow``. What crosses the engine boundary is
plain data for the thread and the process alike: ``commands``, each declared once with what
it does on the engine, and ``messages``, the outputs and limits.
"""
