from __future__ import annotations

import sys

# Ctrl-C while the CLI's modules import (numpy, torch) must not print a traceback.
try:
    from czyx.cli import main
except KeyboardInterrupt:
    print("czyx: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
