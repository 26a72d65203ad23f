"""``python -m corrflow.cli``: the ``corrflow`` command."""

from corrflow.cli import main

main()
