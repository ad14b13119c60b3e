"""``python -m hpctrain`` is the same as the ``hpctrain`` console script."""

from hpctrain.cli import main

raise SystemExit(main())
