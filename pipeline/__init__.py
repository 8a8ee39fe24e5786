"""The face of kdcache: typed config, the CLI, the demo and reports."""
