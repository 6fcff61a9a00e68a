"""Incremental parsers of a choice's text: tool-call syntaxes into OpenAI tool calls
(``tool_calls``) and reasoning into reasoning and content (``reasoning``). Pure text in,
structured pieces out; they know nothing of protos or serving.
"""
