"""Simulated ranks for the scale test bed (issue 27 item 7): ``python -m services.rank.simulated``.

A torch-free rank process speaking the real rank's protocols with the compute replaced by a
sleep (``__main__.py``: the composition root and the step loop); beside it, its session with
the node agent (``session.py``), its train stream (``data_stream.py``), its metric records
(the real rank's ``metrics_client.py``, through the node agent), its checkpoint shard (``shard_save.py``) and the ranks' collective
that stands in for torch.distributed (``collective.py``). The node agent starts it for a
job spec with a ``simulate:`` section; ``bench/scale.py`` runs hundreds of them.
"""
