"""The store: LMDB index, msgpack records, aligned block files, the cffi raw reader,
and model checkpoints mounted as spaces. It never runs a model."""
