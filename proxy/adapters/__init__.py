"""Adapters: the store (diskcache, Redis), the LLM client, the upstream forwarder."""
