"""The state layer: the rank-local state manager, snapshots, and checkpoint storage."""
