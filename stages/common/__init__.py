"""Model-facing helpers that both stages share (no teacher loading here).

No front door: import each name from the module that defines it.
"""
