"""compaction-proxy: an OpenAI-compatible reverse proxy that compacts long conversations."""
