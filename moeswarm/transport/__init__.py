"""Worker links: how the backbone reaches an expert holder.

A TCP connection to a worker process (tcp.py), TLS with the swarm key on it (tls.py, member
certificates in member_cert.py), the same through a relay for a worker that cannot be dialled
(relay.py); which of direct and relay a worker gets is the
path policy (path.py). The fan-out (fanout.py) keeps several requests in flight over them.
"""

FANOUTS = ("star", "chain")  # send every share before awaiting any reply, or one after another
