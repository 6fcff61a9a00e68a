"""Deadlines two services must agree on. A caller waits a little longer than the callee
waits itself, so what the client hears is the callee's own timeout, with its reason."""

from __future__ import annotations

# The scheduler waits this long for its engine to apply a command it must answer (a
# flush, a session open or close, a session's request) before answering UNAVAILABLE.
ENGINE_ANSWER_TIMEOUT_S = 30.0
# What the frontend gives such a scheduler RPC: past the scheduler's own wait.
ENGINE_ANSWER_RPC_TIMEOUT_S = ENGINE_ANSWER_TIMEOUT_S + 5.0
