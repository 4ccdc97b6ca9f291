"""Service `worker`: the node agent and the rank processes it supervises.

* ``node_agent.py``: the node agent (one per node): reports the node's hardware to
  ``control``, starts, stops and kills rank processes on control's command, and relays
  commands down to and events up from them. It takes no decisions. Its parts:
  ``hardware.py``, ``memory_pressure.py``, ``control_link.py`` (session with control and
  its outbox), ``rank_process.py``, ``rank_session.py``, ``log_tail.py``.
* ``__main__.py``: the node agent's composition root (``python -m services.worker``).
* ``rank.py``: one rank process (L2 engine + L3 compute), started by the node agent.

Nothing is imported here, so a rank process does not pay for the agent's modules.
"""
