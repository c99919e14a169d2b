"""The labs' machinery: the grader (`python -m common.labs.grader N`), what a rank runs, the
properties' shared tools, how failures are diagnosed and reported, and the lessons' graded lists."""
