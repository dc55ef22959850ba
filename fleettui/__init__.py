"""fleettui: run a large language model split into pipeline stages over a fleet of PCs."""
