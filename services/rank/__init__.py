"""The rank process: one training rank of one job, started by the node agent.

``python -m services.rank`` is its composition root (``__main__.py``: the L2/L3 modules on
the rank's bus, its relays to control, data and store); beside it, the clients the rank
speaks through (data, store, peer memory copies, checkpoint file transfer), its fault hooks,
and the fork server (``python -m services.rank.forkserver``) the node agent forks its ranks from.
The node agent (services/worker/) only starts, watches and ends these processes.
"""
