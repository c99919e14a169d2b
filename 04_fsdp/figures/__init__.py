"""The code of this chapter's pictures: each figure's data from the code it shows, and its drawing
(common/figures holds the drawing kernel; `make figures` writes them beside this file)."""

from fsdp.figures import hybrid, lesson

FIGURES = [*lesson.FIGURES, *hybrid.FIGURES]
