"""``python -m dblock``: the ``dblock`` command."""

from .cli import main

raise SystemExit(main())
