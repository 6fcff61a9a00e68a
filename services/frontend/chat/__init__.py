"""Chat input: the request's messages as the plain values a chat template receives
(``messages``), and the model's own chat template rendering them to a prompt (``template``).
"""
