"""The dashboard: read-only web pages of the cluster, the queue and each job, served beside
control by its own process (``python -m services.dashboard``).

Everything it shows is read through the same API `surgectl` reads: control's ListJobs /
GetJob / WatchJob / StreamLogs and its /metrics slot census, the store's checkpoint List,
and the store's step records (the metrics file `surgectl plot` reads, else control's
sampled step events). It keeps no state of its own, so it can never disagree with them.

Map: ``series`` (a job's curves from the records), ``charts`` (SVG by matplotlib),
``pages`` (HTML from protobuf messages, pure functions), ``sources`` (the gRPC and /metrics
reads), ``access`` (token and mutual-TLS checks), ``server`` (routes and HTTP),
``__main__`` (the composition root).
"""
