"""`python -m bench.serve`: a load generator for any OpenAI-compatible server.

Random and shared-prefix datasets built from the model's tokenizer, Poisson
arrivals capped by a concurrency limit, per-chunk latency (TTFT, TPOT, ITL,
E2E), JSON and PNG reports, and `compare`/`sweep`: tokenline and a peer
(`transformers serve` or vLLM's CPU engine) side by side on the same model directory.
"""
