"""Anthropic's Messages API (`POST /v1/messages`), translated at the gateway onto the
frontend's ChatCompletion RPC: bodies in, chat request out, chat answers back as Messages."""
