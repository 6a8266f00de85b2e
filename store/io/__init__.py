"""Reading extents: the raw reader, transfer sources over the Linux I/O paths,
the native read pool."""
