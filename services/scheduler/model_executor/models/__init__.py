"""Model code: the Llama architecture (``llama``), its config (``config``), the dtype
choice (``dtype``), packed linears (``linear``) and the safetensors loader (``loader``).
"""
