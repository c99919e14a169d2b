"""The code of this chapter's pictures: each figure's data from the code it shows, and its drawing
(common/figures holds the drawing kernel; `make figures` writes them beside this file)."""

from tensor_parallel.figures import context_parallel, expert_parallel, lesson, router, ulysses

FIGURES = [*lesson.FIGURES, *context_parallel.FIGURES, *ulysses.FIGURES, *expert_parallel.FIGURES,
           *router.FIGURES]
