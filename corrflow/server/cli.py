"""The ``corrflow`` command's former home: it lives in `corrflow.cli` (one module per command).

Kept so that ``python -m corrflow.server.cli`` and console scripts installed before the move keep
working; new code imports `corrflow.cli`.
"""

from corrflow.cli import app, main
from corrflow.cli.plan import plan_table as _plan_table

__all__ = ["app", "main", "_plan_table"]

if __name__ == "__main__":
    main()
