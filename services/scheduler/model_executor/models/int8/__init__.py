"""int8 weights and their matmuls: weight-only (``int8_weight.py``, ``--quantization int8``)
and int8 x int8 (``w8a8_weight.py``, ``--quantization w8a8``). ``../quantization.py`` turns
a loaded model's layers into them."""
