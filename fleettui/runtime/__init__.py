"""Provides the runtime: coordinator, links to the stages, KV ledger, speculation, chat format."""
