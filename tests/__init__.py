"""fleettui's tests: unit, integration, ssh and tui, with helpers in tests.support."""
