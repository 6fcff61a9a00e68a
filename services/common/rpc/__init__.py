"""The gRPC process shell every service shares: the server, its interceptors (metrics,
request decoding, the drain gate) and what they do to a method handler."""
