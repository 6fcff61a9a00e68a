"""From logits to tokens: the ``sampler`` (greedy, temperature, top-k/p/min-p, seeded
draws, logprobs), the ``logits_processor`` (penalties, logit bias, min-tokens), grammar
masks for structured output (``grammar``), a fast row argmax (``row_argmax``) and prompt
logprobs (``prompt_logprobs``). It reads a request through the narrow protocols it
declares, never the scheduler's ``Req``.
"""
