"""Front doors of compaction-proxy inside other proxies (``litellm_compaction``: LiteLLM).

The import name ``hooks`` is generic on purpose (it is what LiteLLM's config names:
``hooks.litellm_compaction.compaction_hook``); all compaction logic lives in ``proxy``.
"""
