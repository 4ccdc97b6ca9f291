"""Service `control` (L1): orchestrator, resource allocator, fault detector, recovery
controller, their SQLite journal, and the gRPC relay. Start it with
``python -m services.control``; the composition root is ``__main__.py``."""
