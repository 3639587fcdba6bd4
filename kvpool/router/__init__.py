"""The cache-aware router in front of N replicas: `index` (what each replica caches, from its KV events),
`policy` (prefix vs load), `subscriber` (ZeroMQ event threads), `app` (the OpenAI-compatible proxy), `cli`."""
