"""The model forward: ``model_runner.ModelRunner`` turns a host-side plan into a
``forward_batch.ForwardBatch``, runs the model over the KV pool and returns the logits of
the rows to sample (and scored prompt rows). ``attention`` holds the pluggable attention
backends; ``models`` the model code (Llama), its config, dtype choice, packed linears and
the safetensors loader.
"""
