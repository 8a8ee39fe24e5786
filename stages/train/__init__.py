"""Stage two: train a student from cached teacher targets, teacher-free."""
