"""Routing locality: does MoE routing have structure a storage layout can use?

Scope: analysis of :class:`inference.trace.RoutingTrace` files (the experiment
of the design source's section 7.1). One module per question:

- :mod:`.usage`: how concentrated is expert usage per layer;
- :mod:`.cooccur`: which experts are routed together, within a layer and
  across adjacent layers;
- :mod:`.temporal`: does token ``t`` reuse token ``t-1``'s experts more than
  chance;
- :mod:`.ordering`: a per-layer class permutation placing co-routed experts on
  adjacent class values (and :func:`.ordering.class_order_from_trace` for mount);
- :mod:`.replay`: cache policies replayed on traces at fixed budgets;
- :mod:`.layout_measure`: run lengths, seeks and bytes per token of a physical
  layout, fetches grouped per layer as the engine issues them.

Everything is numpy; nothing here reads weights or runs a model.
"""

from __future__ import annotations
