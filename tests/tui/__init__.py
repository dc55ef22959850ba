"""The Textual app driven by Pilot, and its snapshots."""
