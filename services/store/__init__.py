"""Service `store` (layer L5): the checkpoint manager (L5-1) and the metrics logger (L5-2).

``checkpoint_manager/`` (a package) and ``metrics_logger.py`` are the two seed modules; ``server.py``
is the gRPC relay that puts each request on the bus from the remote module that sent it;
``__main__.py`` is the composition root (``python -m services.store --port P --metrics-port M``).

On-disk layout under the store root (``--root``, ``SURGE_STORE_ROOT``, default
``$SURGE_HOME/store``)::

    checkpoints/catalog.json                         version chain of every job
    checkpoints/<job_id>/.staging/step-<s>-<token>/  the job's open save (ranks write here)
    checkpoints/<job_id>/<n>/                        version "<job_id>:<n>": DCP index (.metadata,
                                                     chunks.json; older versions: shards) + manifest.json
    checkpoints/<job_id>/chunks/<epoch>/<sha[:2]>/<sha>  content-addressed chunks of an epoch
                                                     (a baseline and its deltas share them)
    metrics/<job_id>.jsonl                           every raw metric record, one JSON line each
"""
