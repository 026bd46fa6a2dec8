"""Command-line tools around training runs."""
