"""``baton bench``: load generators and latency statistics for a running (or locally started) Baton.

``workload`` builds requests and arrival times, ``client`` drives the public gRPC API and records
per-request timings, ``stats`` turns timings into throughput and latency figures, ``report`` prints
them, ``local_stack`` starts redis-server + executor + scheduler processes, and ``cli`` wires it up.
"""
