"""The HTTP routes, one module per API family: OpenAI-compatible (``openai``), SGLang's
native ``/generate`` with tokenize, health and metrics (``native``), operator routes
(``ops``), sessions (``sessions``) and Anthropic's Messages (``messages``). Each converts
JSON to a proto, makes one call to the frontend and renders the answer.
"""
