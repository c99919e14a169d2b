"""The verdict every notebook exercise prints: ✓ or ✗ with the figure that decided.

A chapter's `exercises.py` wraps each check's body in `attempt`, so a stub (NotImplementedError)
or a bug in the student's code prints a ✗ and returns False instead of stopping the notebook.
"""

from __future__ import annotations

from collections.abc import Callable


def attempt(body: Callable[[], tuple[bool, str]], name: str | None = None) -> bool:
    """Run `body` → (ok, figure); print "✓/✗ [name: ]figure"; return ok (False on any exception)."""
    try:
        ok, figure = body()
    except NotImplementedError:
        ok, figure = False, "not solved yet"
    except Exception as error:  # the student's code may raise anything
        ok, figure = False, f"your function raised {type(error).__name__}: {error}"
    print(f"{'✓' if ok else '✗'} {f'{name}: ' if name else ''}{figure}")
    return ok
