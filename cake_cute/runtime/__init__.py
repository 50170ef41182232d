"""The host runtime below the entries: device facts, launch plans, tensor views, kernel specs, the
build and its caches, and the native (C++) host path."""
