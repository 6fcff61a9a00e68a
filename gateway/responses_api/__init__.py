"""OpenAI's Responses API on the frontend's ResponsesCreate RPCs (responses.proto)."""
