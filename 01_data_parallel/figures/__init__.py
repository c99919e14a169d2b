"""The code of this chapter's pictures: each figure's data from the code it shows, and its drawing
(common/figures holds the drawing kernel; `make figures` writes them beside this file)."""

from data_parallel.figures import fp8, lesson, numerics

FIGURES = [*lesson.FIGURES, *numerics.FIGURES, *fp8.FIGURES]
