"""The storage core: LMDB index, records, aligned block files, snapshots, publishing, fsck."""
