from __future__ import annotations

from czyx.cli import main

raise SystemExit(main())
