"""The contract: generated proto messages, the route table read from their options, the bus.

Generated code lives in ``gen/`` (``make proto``) and is never edited. Its imports are
``from surge.v1 import ...``, so ``gen/`` joins ``sys.path`` here, in one place.
"""

import sys

from services.generated_code import GEN as _gen_dir
from services.generated_code import missing as _missing

if _not_generated := _missing():  # (not "No module named 'surge'" from the import below)
    raise ImportError(_not_generated)

_GEN = str(_gen_dir)
if _GEN not in sys.path:
    sys.path.insert(0, _GEN)

from surge.v1 import (  # noqa: E402
    audit_pb2,
    audit_pb2_grpc,
    control_pb2,
    control_pb2_grpc,
    data_pb2,
    data_pb2_grpc,
    engine_pb2,
    route_pb2,
    store_pb2,
    store_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

Module = route_pb2.Module

__all__ = [
    "Module",
    "audit_pb2",
    "audit_pb2_grpc",
    "control_pb2",
    "control_pb2_grpc",
    "data_pb2",
    "data_pb2_grpc",
    "engine_pb2",
    "route_pb2",
    "store_pb2",
    "store_pb2_grpc",
    "worker_pb2",
    "worker_pb2_grpc",
]
