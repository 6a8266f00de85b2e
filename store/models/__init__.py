"""Model knowledge: checkpoint parsing, per-architecture naming, and mount, open and
export of model versions."""
