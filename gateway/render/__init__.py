"""Response protos to JSON: the OpenAI shapes (``openai``) and SGLang's ``/generate`` shape
(``generate``), both through the models in ``gateway.responses``, and SSE frames of plain
text chunks written from a template (``text_frames``).
"""
