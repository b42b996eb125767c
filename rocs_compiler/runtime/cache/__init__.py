"""The request cache: the shared graph split at the request boundary, and the cache itself."""
