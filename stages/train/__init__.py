"""Stage two: train a student from cached teacher targets, teacher-free.

No front door: import each name from the module that defines it.
"""
