"""One serving class per API, each turning a request proto into prompts, dispatching them and
assembling the response: chat (``chat``, with ``chat_output`` reading reasoning and tool
calls and ``tool_choice`` deciding whether to), completions (``completion``), the native
generate (``generate``), and the operator RPCs (``operations``); ``base`` holds what they
share and ``output`` the pieces of response assembly every API uses.
"""
