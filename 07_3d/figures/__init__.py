"""The code of this chapter's pictures: each figure's data from the code it shows, and its drawing
(common/figures holds the drawing kernel; `make figures` writes them beside this file)."""

from parallel3d.figures import checkpoint, experts_and_hybrid, lesson, planner

FIGURES = [*lesson.FIGURES, *experts_and_hybrid.FIGURES, *planner.FIGURES, *checkpoint.FIGURES]
