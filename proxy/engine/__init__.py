"""The engine: runs the core's compaction flow against the adapters."""
