"""`python -m parallel3d.planner`: the planner's command line (cli.py)."""

from parallel3d.planner.cli import main

raise SystemExit(main())
