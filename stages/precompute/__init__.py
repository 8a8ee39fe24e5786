"""Stage one: run the teacher once and write its targets to a cache.

No front door: import each name from the module that defines it.
"""
