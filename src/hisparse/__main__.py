"""``python -m hisparse``: the ``hisparse`` command line."""

from hisparse.cli import main

raise SystemExit(main())
