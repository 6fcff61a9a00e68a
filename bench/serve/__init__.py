"""`python -m bench.serve`: a load generator for any OpenAI-compatible server.

Random and shared-prefix datasets built from the model's tokenizer, Poisson
arrivals capped by a concurrency limit, per-chunk latency (TTFT, TPOT, ITL,
E2E), JSON and PNG reports, and `compare`: tokenline and `transformers serve`
side by side on the same model directory.
"""
