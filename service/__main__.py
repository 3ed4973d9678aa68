"""``python -m wattflow.service`` runs the ``wattflow`` command."""

import sys

from wattflow.service.cli import main

sys.exit(main())
